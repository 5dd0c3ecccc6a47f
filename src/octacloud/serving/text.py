"""Raw text in: a text model's tokenizer runs in the replica.

A model version whose config names a tokenizer file (parameter ``octacloud.text.tokenizer``, a Hugging Face
``tokenizers`` JSON file in the version folder, as ``octacloud convert`` publishes with text models) can be
asked with one ``BYTES`` input of UTF-8 text, one string per batch row, instead of its token inputs::

    {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [2, 1], "data": ["first", "second"]}]}

The replica tokenizes the rows and feeds the model's ``input_ids``, ``attention_mask`` and ``token_type_ids``
(whichever it declares). Every row is padded, and truncated, to the same length (parameter
``octacloud.text.max_length``, else the tokenizer file's own padding length, else 128), so that requests of
different lengths batch together. The input's name is ``text`` unless ``octacloud.text.input`` says otherwise.
Token inputs may still be sent as before; a request gives one or the other.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc

from octacloud.serving.errors import InvalidInputError, ModelConfigError
from octacloud.serving.repository.config import int_parameter, parameter
from octacloud.serving.types import InferenceRequest, Tensor

if TYPE_CHECKING:
    from tokenizers import Encoding, Tokenizer

PARAM_TOKENIZER = "octacloud.text.tokenizer"
PARAM_MAX_LENGTH = "octacloud.text.max_length"
PARAM_INPUT = "octacloud.text.input"
DEFAULT_INPUT = "text"
DEFAULT_MAX_LENGTH = 128
TOKEN_INPUTS = ("input_ids", "attention_mask", "token_type_ids")
PAD_TOKENS = ("[PAD]", "<pad>", "<|pad|>")


@dataclass(frozen=True, slots=True)
class TokenInput:
    name: str
    dtype: np.dtype[Any]
    batched: bool
    """The model takes ``[batch, tokens]``; otherwise ``[tokens]`` (one row per request)."""


class TextInput:
    """Turns a request's text input into the model's token inputs (see the module docstring)."""

    def __init__(self, tokenizer: Tokenizer, name: str, max_length: int, token_inputs: Sequence[TokenInput]) -> None:
        self.tokenizer = tokenizer
        self.name = name
        self.max_length = max_length
        self.token_inputs = tuple(token_inputs)

    @classmethod
    def load(cls, version_dir: Path, config: mc.ModelConfig) -> TextInput | None:
        """The model's text input, or ``None`` when its config names no tokenizer.

        Raises :class:`ModelConfigError` when the tokenizer file is missing or unreadable, when the model
        declares none of the token inputs, or when the max length is not a positive integer.
        """
        filename = parameter(config, PARAM_TOKENIZER)
        if not filename:
            return None
        path = version_dir / filename
        if Path(filename).is_absolute() or ".." in Path(filename).parts:
            raise ModelConfigError(f"parameter {PARAM_TOKENIZER}: {filename!r} must name a file in the version folder")
        if not path.is_file():
            raise ModelConfigError(f"parameter {PARAM_TOKENIZER}: {path} does not exist")
        from tokenizers import Tokenizer

        try:
            tokenizer = Tokenizer.from_file(str(path))
        except Exception as e:
            raise ModelConfigError(f"{path}: not a tokenizers file: {e}") from None
        configured = int_parameter(config, PARAM_MAX_LENGTH)  # a malformed one is a ModelConfigError
        padding = tokenizer.padding or {}
        max_length = configured or padding.get("length") or DEFAULT_MAX_LENGTH
        if max_length < 1:
            raise ModelConfigError(f"parameter {PARAM_MAX_LENGTH} must be a positive integer, got {max_length}")
        pad_id = padding.get("pad_id", _pad_id(tokenizer))
        tokenizer.enable_padding(
            length=max_length,
            pad_id=pad_id,
            pad_token=padding.get("pad_token", tokenizer.id_to_token(pad_id) or "[PAD]"),
            pad_type_id=padding.get("pad_type_id", 0),
        )
        tokenizer.enable_truncation(max_length)
        batched = config.max_batch_size > 0
        token_inputs = []
        for entry in config.input:
            if entry.name in TOKEN_INPUTS:
                rank = len(entry.dims) + (1 if batched else 0)
                dtype = np.dtype(np.int32) if entry.data_type == mc.TYPE_INT32 else np.dtype(np.int64)
                token_inputs.append(TokenInput(entry.name, dtype, rank == 2))
        if not token_inputs:
            raise ModelConfigError(
                f"parameter {PARAM_TOKENIZER} is set but the model has none of the token inputs {list(TOKEN_INPUTS)}"
            )
        name = parameter(config, PARAM_INPUT) or DEFAULT_INPUT
        return cls(tokenizer, name, max_length, token_inputs)

    def translate(self, request: InferenceRequest) -> InferenceRequest:
        """``request`` with its text input replaced by token inputs; unchanged when it has no text input."""
        texts = [t for t in request.inputs if t.name == self.name]
        if not texts:
            return request
        if len(texts) > 1:
            raise InvalidInputError(f"input {self.name!r} is given twice")
        others = [t.name for t in request.inputs if t.name != self.name]
        if others:
            raise InvalidInputError(
                f"input {self.name!r} (raw text) replaces the token inputs: send it alone, not with {others}"
            )
        rows = self._rows(texts[0])
        encodings = self.tokenizer.encode_batch(rows)
        return replace(request, inputs=[self._tensor(spec, encodings) for spec in self.token_inputs])

    def _rows(self, tensor: Tensor) -> list[str]:
        if tensor.datatype != "BYTES":
            raise InvalidInputError(
                f"input {self.name!r} holds text: its datatype must be BYTES, not {tensor.datatype}"
            )
        batched = any(s.batched for s in self.token_inputs)
        shape = tuple(tensor.shape)
        if batched and not (len(shape) == 1 or (len(shape) == 2 and shape[1] == 1)):
            raise InvalidInputError(
                f"input {self.name!r}: shape {list(shape)} must be [batch] or [batch, 1] (one string per row)"
            )
        if not batched and int(np.prod(shape, dtype=np.int64)) != 1:
            raise InvalidInputError(f"input {self.name!r}: this model takes one string per request, got {list(shape)}")
        if int(np.prod(shape, dtype=np.int64)) < 1:
            raise InvalidInputError(f"input {self.name!r}: no text given (shape {list(shape)})")
        rows = []
        for i, value in enumerate(np.asarray(tensor.data, dtype=object).reshape(-1)):
            try:
                rows.append(value.decode("utf-8") if isinstance(value, bytes | bytearray) else str(value))
            except UnicodeDecodeError as e:
                raise InvalidInputError(f"input {self.name!r}: row {i} is not UTF-8 text ({e.reason})") from None
        return rows

    def _tensor(self, spec: TokenInput, encodings: Sequence[Encoding]) -> Tensor:
        field = {"input_ids": "ids", "attention_mask": "attention_mask", "token_type_ids": "type_ids"}[spec.name]
        array = np.array([getattr(e, field) for e in encodings], dtype=spec.dtype)
        if not spec.batched:
            array = array[0]
        return Tensor(spec.name, "INT32" if spec.dtype == np.int32 else "INT64", tuple(array.shape), array)


def _pad_id(tokenizer: Tokenizer) -> int:
    for token in PAD_TOKENS:
        found = tokenizer.token_to_id(token)
        if found is not None:
            return int(found)
    return 0
