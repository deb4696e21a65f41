"""A tokenizer straight over `tokenizers` (tokenizer.json), with the part of transformers'
tokenizer interface kvserve and its callers use.

Why not transformers' PreTrainedTokenizerFast over the same file: importing transformers
takes ~0.5 s and the class's set-up another ~0.4 s on top of parsing the file (~0.7 s
for Gemma 3's 262k vocabulary on 2 cores), and the tokenizer is on the critical path of a
warm start once the model maps in a fraction of a second (models/packed.py). The ids and
text are the `tokenizers` pipeline's either way (normalizer, pre-tokenizer, added tokens,
BOS post-processor), so they are the same (tests/models/test_gemma3_reference.py checks
them against AutoTokenizer). transformers is imported only to render a chat template,
with its own renderer, so templates behave exactly as they do there.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer

# transformers' named special tokens, in its order (all_special_ids follows it).
SPECIAL_ATTRIBUTES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                      "cls_token", "mask_token")
_EXTRA_KEYS = ("extra_special_tokens", "additional_special_tokens")


class Encoding(dict):
    """transformers' BatchEncoding in the small: keys also read as attributes."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class FastTokenizer:
    """encode / decode / chat template over a `tokenizers.Tokenizer`."""

    def __init__(self, backend: Tokenizer, special: Mapping[str, str],
                 extra_special: Sequence[str] = (), chat_template: str | None = None,
                 clean_up_tokenization_spaces: bool = False) -> None:
        if clean_up_tokenization_spaces:
            # transformers' clean-up rewrites text after decoding; kvserve's tokenizers
            # (Gemma, SmolLM2) turn it off, and nothing here reproduces it.
            raise ValueError("clean_up_tokenization_spaces is not supported")
        self.backend = backend
        self.special_tokens_map = {k: special[k] for k in SPECIAL_ATTRIBUTES if special.get(k)}
        self.extra_special_tokens = list(extra_special)
        self.chat_template = chat_template
        self._mark_special()

    @classmethod
    def from_files(cls, tokenizer_file: Path, config_file: Path,
                   chat_template: str | None = None) -> FastTokenizer:
        """tokenizer.json plus the named special tokens (and the chat template, unless
        given) of tokenizer_config.json."""
        config = json.loads(Path(config_file).read_text())
        special = {k: _token_text(config[k]) for k in SPECIAL_ATTRIBUTES if config.get(k)}
        extra = next((config[k] for k in _EXTRA_KEYS if config.get(k)), [])
        if isinstance(extra, dict):  # transformers 5's model-specific named tokens
            extra = list(extra.values())
        return cls(Tokenizer.from_file(str(tokenizer_file)), special,
                   [_token_text(t) for t in extra],
                   chat_template or config.get("chat_template"),
                   bool(config.get("clean_up_tokenization_spaces", False)))

    def _mark_special(self) -> None:
        """Register the named tokens as special where the file does not (transformers
        does the same), so decode's skip_special_tokens drops them."""
        have = {t.content for t in self.backend.get_added_tokens_decoder().values() if t.special}
        missing = [t for t in self.all_special_tokens if t not in have]
        if missing:
            self.backend.add_special_tokens(
                [AddedToken(t, special=True, normalized=False) for t in missing])

    # ------------------------------------------------------------------ ids and text

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def __call__(self, text: str | Sequence[str], add_special_tokens: bool = True) -> Encoding:
        """{"input_ids", "attention_mask"} of a text, or lists of them for a list of texts."""
        if isinstance(text, str):
            ids = self.encode(text, add_special_tokens)
            return Encoding(input_ids=ids, attention_mask=[1] * len(ids))
        batch = self.backend.encode_batch(list(text), add_special_tokens=add_special_tokens)
        return Encoding(input_ids=[e.ids for e in batch],
                        attention_mask=[e.attention_mask for e in batch])

    def decode(self, ids: int | Sequence[int], skip_special_tokens: bool = False) -> str:
        ids = [ids] if isinstance(ids, int) else [int(i) for i in ids]
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def batch_decode(self, batch: Sequence[Sequence[int]],
                     skip_special_tokens: bool = False) -> list[str]:
        return [self.decode(ids, skip_special_tokens) for ids in batch]

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> int | list[int] | None:
        """A token's id (the unknown token's for one not in the vocabulary, as
        transformers); a list for a list."""
        if isinstance(tokens, str):
            found = self.backend.token_to_id(tokens)
            return found if found is not None else self.unk_token_id
        return [self.convert_tokens_to_ids(t) for t in tokens]

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> str | list[str] | None:
        if isinstance(ids, int):
            return self.backend.id_to_token(ids)
        return [self.backend.id_to_token(int(i)) for i in ids]

    def get_vocab(self) -> dict[str, int]:
        return self.backend.get_vocab(with_added_tokens=True)

    def __len__(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        """The base vocabulary, without added tokens (transformers' meaning)."""
        return self.backend.get_vocab_size(with_added_tokens=False)

    # ------------------------------------------------------------------ special tokens

    def __getattr__(self, name: str) -> Any:
        # bos_token, eos_token_id, ...: only reached for names not set on the instance.
        base = name.removesuffix("_id")
        if base in SPECIAL_ATTRIBUTES:
            token = self.__dict__.get("special_tokens_map", {}).get(base)
            if base == name or token is None:
                return token
            return self.backend.token_to_id(token)
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    @property
    def all_special_tokens(self) -> list[str]:
        """Named then extra special tokens, each once (transformers' order)."""
        return list(dict.fromkeys([*self.special_tokens_map.values(),
                                   *self.extra_special_tokens]))

    @property
    def all_special_ids(self) -> list[int]:
        return self.convert_tokens_to_ids(self.all_special_tokens)

    # ------------------------------------------------------------------ chat

    def apply_chat_template(self, conversation: Sequence[Mapping[str, Any]],
                            add_generation_prompt: bool = False, tokenize: bool = True,
                            return_dict: bool = True, chat_template: str | None = None,
                            continue_final_message: bool | str = False,
                            tools: list | None = None, documents: list | None = None,
                            **kwargs: Any) -> str | list[int] | Encoding:
        """One conversation rendered with the chat template (transformers' renderer and
        template variables: the named special tokens, then kwargs); tokenized without
        adding special tokens (the template writes them) unless tokenize is False."""
        from transformers.utils.chat_template_utils import render_jinja_template

        template = chat_template or self.chat_template
        if not template:
            raise ValueError("this tokenizer has no chat template")
        if not conversation:
            raise ValueError("Cannot apply chat template to an empty conversation.")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt are not "
                             "compatible")
        # As transformers: keys whose value is None are dropped (OpenAI's content=None).
        chat = [{k: v for k, v in m.items() if v is not None} for m in conversation]
        rendered, _ = render_jinja_template(
            conversations=[chat], tools=tools, documents=documents, chat_template=template,
            continue_final_message=continue_final_message,
            add_generation_prompt=add_generation_prompt,
            **{**self.special_tokens_map, **kwargs})
        if not tokenize:
            return rendered[0]
        out = self(rendered[0], add_special_tokens=False)
        return out if return_dict else out["input_ids"]

    def save_pretrained(self, directory: str | Path) -> None:
        """tokenizer.json, tokenizer_config.json (and chat_template.jinja): what from_files
        and transformers' AutoTokenizer read back."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(out / "tokenizer.json"))
        config = {"tokenizer_class": "PreTrainedTokenizerFast", **self.special_tokens_map}
        if self.extra_special_tokens:
            config["extra_special_tokens"] = self.extra_special_tokens
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
        if self.chat_template:
            (out / "chat_template.jinja").write_text(self.chat_template)


def compact_merges(tokenizer_file: Path) -> bool:
    """Rewrite a BPE tokenizer.json's merges from pairs to "left right" strings, unless a
    token holds a space (then the string form would split it wrongly); True if rewritten.

    Why: `tokenizers` parses the string form about twice as fast (Gemma 3's 514,906
    merges: 0.9-1.0 s for the whole file against 1.4-1.6 s as pairs, on the slower
    2-core VMs), and the tokenizer is on the critical path of a warm start. Both forms
    build the same merge table, so the ids are the same (test)."""
    path = Path(tokenizer_file)
    data = json.loads(path.read_text(encoding="utf-8"))
    model = data.get("model", {})
    merges = model.get("merges")
    if model.get("type") != "BPE" or not merges or isinstance(merges[0], str) \
            or any(" " in token for token in model["vocab"]):
        return False
    model["merges"] = [f"{left} {right}" for left, right in merges]
    path.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    return True


def _token_text(value: Any) -> Any:
    """A special token as tokenizer_config.json stores it (a string, or an AddedToken's
    fields), as text."""
    return value["content"] if isinstance(value, dict) else value
