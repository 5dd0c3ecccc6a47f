"""Image classification with the pre-processing the model states, and Triton's classification extension.

    .venv/bin/python examples/image_classification.py photo.jpg           # needs Pillow to read the file
    .venv/bin/python examples/image_classification.py --synthetic         # a generated test image, numpy only

The model's config says how an image becomes its input (parameters `octacloud.image.*`: size, resize,
rescale, mean and std, RGB, NCHW); this client reads them from the server, prepares the image accordingly and
asks for the top classes (`class_count`), which come back as "score:index[:label]".

Against the cloud (`make up`): the gateway at 127.0.0.1:8000 and an API key in $OCTACLOUD_KEY. Against one
`octacloud serve`: --url HOST:PORT, no key. The example ResNet-50 carries seeded, untrained weights: its
classes mean nothing. Convert a trained model (`octacloud convert path/to/hf-model --name NAME`) for real ones.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

PREFIX = "octacloud.image."


def image_recipe(config: dict[str, Any]) -> dict[str, Any]:
    """The pre-processing parameters of a model config (as the REST API returns it)."""
    params = {
        k[len(PREFIX) :]: v["string_value"] for k, v in config.get("parameters", {}).items() if k.startswith(PREFIX)
    }
    if not params:
        raise SystemExit(f"model {config.get('name')!r} states no image pre-processing (parameters {PREFIX}*)")
    return {
        "height": int(params["height"]),
        "width": int(params["width"]),
        "resize": int(params["resize_shortest_edge"]),
        "rescale": float(params["rescale"]),
        "mean": np.array([float(v) for v in params["mean"].split(",")], np.float32),
        "std": np.array([float(v) for v in params["std"].split(",")], np.float32),
    }


def load_image(path: Path, recipe: dict[str, Any]) -> np.ndarray:
    """An RGB image file resized (shorter side), centre-cropped: uint8 [H, W, 3]."""
    try:
        from PIL import Image
    except ImportError:
        raise SystemExit("reading an image file needs Pillow (pip install pillow), or pass --synthetic") from None
    image = Image.open(path).convert("RGB")
    scale = recipe["resize"] / min(image.size)
    image = image.resize((round(image.width * scale), round(image.height * scale)), Image.Resampling.BILINEAR)
    left, top = (image.width - recipe["width"]) // 2, (image.height - recipe["height"]) // 2
    image = image.crop((left, top, left + recipe["width"], top + recipe["height"]))
    return np.asarray(image, dtype=np.uint8)


def synthetic_image(recipe: dict[str, Any]) -> np.ndarray:
    """A colour gradient of the model's input size: uint8 [H, W, 3]."""
    h, w = recipe["height"], recipe["width"]
    y, x = np.mgrid[0:h, 0:w]
    return np.stack(
        [x * 255 // max(w - 1, 1), y * 255 // max(h - 1, 1), (x + y) * 255 // max(h + w - 2, 1)], -1
    ).astype(np.uint8)


def to_input(pixels: np.ndarray, recipe: dict[str, Any]) -> np.ndarray:
    """uint8 [H, W, 3] → the model's float32 [1, 3, H, W]: rescale, normalise, channels first."""
    x = pixels.astype(np.float32) * recipe["rescale"]
    x = (x - recipe["mean"]) / recipe["std"]
    return np.ascontiguousarray(x.transpose(2, 0, 1)[None])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("image", nargs="?", type=Path, help="an image file (JPEG, PNG, ...)")
    parser.add_argument("--synthetic", action="store_true", help="classify a generated test image instead")
    parser.add_argument("--url", default="127.0.0.1:8000", help="REST endpoint (default: the gateway)")
    parser.add_argument(
        "--model", default="resnet50_int8", help="an image model (default: resnet50_int8, as the README deploys it)"
    )
    parser.add_argument("--top", type=int, default=5, help="how many classes to print")
    parser.add_argument("--key", default=os.environ.get("OCTACLOUD_KEY"), help="API key (default $OCTACLOUD_KEY)")
    args = parser.parse_args(argv)
    if (args.image is None) == (not args.synthetic):
        parser.error("give an image file or --synthetic")

    headers = {"Authorization": f"Bearer {args.key}"} if args.key else None
    client = httpclient.InferenceServerClient(args.url)
    try:
        config = client.get_model_config(args.model, headers=headers)
        recipe = image_recipe(config)
        pixels = load_image(args.image, recipe) if args.image else synthetic_image(recipe)
        inp = config["input"][0]
        x = httpclient.InferInput(inp["name"], [1, 3, recipe["height"], recipe["width"]], "FP32")
        x.set_data_from_numpy(to_input(pixels, recipe))
        output = httpclient.InferRequestedOutput(config["output"][0]["name"], class_count=args.top)
        result = client.infer(args.model, [x], outputs=[output], headers=headers)
    except InferenceServerException as e:
        print(f"error: {e.message()}", file=sys.stderr)
        return 1
    finally:
        client.close()
    print(f"{args.model}: top {args.top} of {args.image or 'a synthetic image'} (score:index[:label])")
    for entry in result.as_numpy(output.name())[0]:
        print(entry.decode() if isinstance(entry, bytes) else entry)
    return 0


if __name__ == "__main__":
    sys.exit(main())
