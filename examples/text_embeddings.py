"""Sentence embeddings from raw text: the example MiniLM tokenizes in the replica.

    .venv/bin/python examples/text_embeddings.py "A man is eating food." "Someone has a meal." "The sky is blue."

Against the cloud (`make up`): the gateway at 127.0.0.1:8000 and an API key in $OCTACLOUD_KEY (for example
`export OCTACLOUD_KEY=$(cat var/admin.key)`). Against one `octacloud serve`: --url HOST:PORT, no key.
Prints the embeddings' size and their cosine similarities (MiniLM's embeddings are L2-normalised, so the dot
product is the cosine). Needs only tritonclient and numpy.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("texts", nargs="+", help="the sentences to embed")
    parser.add_argument("--url", default="127.0.0.1:8000", help="REST endpoint (default: the gateway)")
    parser.add_argument("--model", default="minilm", help="a text model published with its tokenizer")
    parser.add_argument("--key", default=os.environ.get("OCTACLOUD_KEY"), help="API key (default $OCTACLOUD_KEY)")
    args = parser.parse_args(argv)

    headers = {"Authorization": f"Bearer {args.key}"} if args.key else None
    client = httpclient.InferenceServerClient(args.url)
    text = httpclient.InferInput("text", [len(args.texts), 1], "BYTES")
    text.set_data_from_numpy(np.array([[t.encode()] for t in args.texts], dtype=object))
    try:
        result = client.infer(args.model, [text], headers=headers)
    except InferenceServerException as e:
        print(f"error: {e.message()}", file=sys.stderr)
        return 1
    finally:
        client.close()
    output = result.get_response()["outputs"][0]["name"]
    embeddings = np.asarray(result.as_numpy(output), dtype=np.float64)
    print(f"{args.model}: {len(args.texts)} text(s) -> {output} {list(embeddings.shape)}")
    unit = embeddings / np.linalg.norm(embeddings, axis=1, keepdims=True)
    similarity = unit @ unit.T
    for i, t in enumerate(args.texts):
        row = "  ".join(f"{similarity[i, j]:6.3f}" for j in range(len(args.texts)))
        print(f"{row}   {t}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
