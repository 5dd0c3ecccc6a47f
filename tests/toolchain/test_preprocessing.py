"""Models carry their pre-processing: text models their tokenizer (and take raw text when served), image models
their input size and normalisation."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as grpcclient
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from octacloud.toolchain.convert import convert
from octacloud.toolchain.errors import SourceError
from octacloud.toolchain.repository import ModelRepository
from octacloud.toolchain.sources import SourceOptions, load_source

from .conftest import MLP_INPUT, fast_options
from .test_serve import served

WORDS = ["the", "cat", "sat", "on", "mat", "dog", "ran", "##s", "a", "octa", "##cloud"]
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]


def write_wordpiece(directory: Path) -> Path:
    """A BERT-style uncased WordPiece tokenizer over a tiny vocabulary, as ``tokenizer.json`` + ``vocab.txt``."""
    from tokenizers import Tokenizer, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordPiece

    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(WordPiece({t: i for i, t in enumerate(VOCAB)}, unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)  # type: ignore[assignment]
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()  # type: ignore[assignment]
    tokenizer.post_processor = processors.TemplateProcessing(  # type: ignore[assignment]
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    return directory


def tiny_bert(directory: Path, with_tokenizer: bool = True) -> Path:
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=len(VOCAB),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=37,
        max_position_embeddings=64,
    )
    transformers.BertModel(config).save_pretrained(directory)
    (directory / "modules.json").write_text(
        json.dumps(
            [
                {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            ]
        )
    )
    (directory / "1_Pooling").mkdir()
    (directory / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    if with_tokenizer:
        write_wordpiece(directory)
    return directory


def config_of(repo: Path, name: str) -> mc.ModelConfig:
    return text_format.Parse((repo / name / "config.pbtxt").read_text(), mc.ModelConfig())


def test_a_text_model_publishes_its_tokenizer_and_takes_raw_text_when_served(tmp_path: Path) -> None:
    source = load_source(tiny_bert(tmp_path / "bert"))
    repo = tmp_path / "repo"
    convert(source, ModelRepository(repo), fast_options("emb", precisions=("fp32", "int8")))
    for name in ("emb", "emb_int8"):
        version = repo / name / "1"
        assert {"tokenizer.json", "vocab.txt"} <= {p.name for p in version.iterdir()}, name
        params = config_of(repo, name).parameters
        assert params["octacloud.text.tokenizer"].string_value == "tokenizer.json"
        assert params["octacloud.text.max_length"].string_value == "64"  # the model's position limit (< 128)
        published = json.loads((version / "tokenizer.json").read_text())
        assert published["padding"]["strategy"] == {"Fixed": 64} and published["truncation"]["max_length"] == 64

    from tokenizers import Tokenizer

    texts = ["The cat sat on the mat", "octacloud dogs ran", "a " * 100]  # the last is truncated to 64 tokens
    tokenizer = Tokenizer.from_file(str(repo / "emb" / "1" / "tokenizer.json"))
    encodings = tokenizer.encode_batch(texts)
    feeds = {
        "input_ids": np.array([e.ids for e in encodings], np.int64),
        "attention_mask": np.array([e.attention_mask for e in encodings], np.int64),
        "token_type_ids": np.array([e.type_ids for e in encodings], np.int64),
    }
    assert encodings[1].tokens[:5] == ["[CLS]", "octa", "##cloud", "dog", "##s"]
    expected = ort.InferenceSession(str(repo / "emb" / "1" / "model.onnx")).run(None, feeds)[0]
    with served(repo) as client:
        text = grpcclient.InferInput("text", [len(texts), 1], "BYTES")
        text.set_data_from_numpy(np.array([[t.encode()] for t in texts], dtype=object))
        got = client.infer("emb", [text]).as_numpy("sentence_embedding")
    np.testing.assert_allclose(got, expected, atol=1e-5)


def test_an_onnx_text_model_gets_the_tokenizer_it_is_given(tmp_path: Path) -> None:
    bert = tiny_bert(tmp_path / "bert", with_tokenizer=False)
    plain = load_source(bert)
    assert plain.preprocessing is None  # no tokenizer.json beside the weights: nothing to publish
    repo = tmp_path / "repo"
    convert(plain, ModelRepository(repo), fast_options("plain", precisions=("fp32",)))
    assert not (repo / "plain" / "1" / "tokenizer.json").exists()
    assert "octacloud.text.tokenizer" not in config_of(repo, "plain").parameters
    onnx_source = load_source(repo / "plain" / "1" / "model.onnx")
    tokenizer = write_wordpiece(tmp_path / "tok") / "tokenizer.json"
    options = fast_options("from_onnx", precisions=("fp32",), tokenizer=tokenizer, max_text_length=16)
    convert(onnx_source, ModelRepository(repo), options)
    assert (repo / "from_onnx" / "1" / "tokenizer.json").is_file()
    assert config_of(repo, "from_onnx").parameters["octacloud.text.max_length"].string_value == "16"


def test_a_tokenizer_is_refused_where_it_cannot_apply(mlp_file: Path, tmp_path: Path) -> None:
    repo = ModelRepository(tmp_path / "repo")
    mlp = load_source(mlp_file, SourceOptions(inputs=(MLP_INPUT,), output_names=("logits",)))
    tokenizer = write_wordpiece(tmp_path / "tok")
    with pytest.raises(SourceError, match="a tokenizer is for text models"):
        convert(mlp, repo, fast_options("mlp", tokenizer=tokenizer))
    with pytest.raises(SourceError, match="needs a tokenizer"):
        convert(mlp, repo, fast_options("mlp", max_text_length=32))
    bert = load_source(tiny_bert(tmp_path / "bert", with_tokenizer=False))
    with pytest.raises(SourceError, match=r"no tokenizer at .*expected tokenizer.json"):
        convert(bert, repo, fast_options("bert", tokenizer=tmp_path / "missing"))
    assert repo.models() == []  # nothing was published


def test_an_image_model_states_its_input_size_and_normalisation(tmp_path: Path) -> None:
    import transformers

    config = transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic")
    config.num_labels = 3
    config.architectures = ["ResNetForImageClassification"]
    config.save_pretrained(tmp_path / "default")
    config.save_pretrained(tmp_path / "own")
    (tmp_path / "own" / "preprocessor_config.json").write_text(
        json.dumps(
            {"size": {"shortest_edge": 224}, "crop_pct": 0.8, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.25] * 3}
        )
    )
    repo = tmp_path / "repo"
    for name, folder in (("rn_default", tmp_path / "default" / "config.json"), ("rn_own", tmp_path / "own")):
        options = SourceOptions(seed=1, random_init=True)
        convert(load_source(folder, options), ModelRepository(repo), fast_options(name, precisions=("fp32",)))
    params = {k: v.string_value for k, v in config_of(repo, "rn_default").parameters.items() if "image" in k}
    assert params == {
        "octacloud.image.layout": "NCHW",
        "octacloud.image.channel_order": "RGB",
        "octacloud.image.height": "224",
        "octacloud.image.width": "224",
        "octacloud.image.resize_shortest_edge": "256",
        "octacloud.image.rescale": "0.003921568627",
        "octacloud.image.mean": "0.485,0.456,0.406",
        "octacloud.image.std": "0.229,0.224,0.225",
    }
    own = config_of(repo, "rn_own").parameters
    assert own["octacloud.image.resize_shortest_edge"].string_value == "280"
    assert own["octacloud.image.mean"].string_value == "0.5,0.5,0.5"
    assert own["octacloud.image.std"].string_value == "0.25,0.25,0.25"
