"""Build the deterministic tiny Llama demo base model, fully offline.

The demo needs a base model that is never downloaded and whose files hash the same on every
machine, so the manifest's ``base_model.tree_sha256`` is reproducible. ``build_tiny_model``
trains a byte-level BPE tokenizer on fixed, bundled text (the sample dataset's strings plus
``app/data/tokenizer_corpus.txt``: never stdlib sources, which differ between Python versions),
builds a 2-layer Llama-shaped model from a fixed torch seed and saves both with safetensors.

Run by hand: ``python -c "from pathlib import Path; from app.training import build_tiny_model;
build_tiny_model(Path('tiny-llama'))"``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

from app.errors import BaseModelError, StateError
from app.fsutil import fsync_dir, fsync_tree

from . import set_offline_env

logger = logging.getLogger(__name__)

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
SAMPLE_JSONL = DATA_DIR / "sample.jsonl"
EXTRA_CORPUS = DATA_DIR / "tokenizer_corpus.txt"

VOCAB_SIZE = 768
SEED = 0
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"]

# The files a finished build always has; an existing directory with all of them is reused.
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
)

# ChatML-style; the {% generation %} markers make TRL's assistant_only_loss work. Newlines are
# emitted from {{ '...\n' }} expressions because HF renders templates with trim_blocks, which
# would eat a literal newline after a block tag (and {%- -%} would drop the one after <|im_end|>).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{% else %}{{ message['content'] + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def is_complete(model_dir: Path) -> bool:
    """True when ``model_dir`` holds every file a finished build writes."""
    return all((Path(model_dir) / name).is_file() for name in MODEL_FILES)


def corpus_texts() -> list[str]:
    """The fixed tokenizer corpus, in file order: sample dataset strings, then the extra corpus lines.

    Raises:
        BaseModelError: a bundled corpus file is missing or unreadable.
    """
    texts: list[str] = ["system user assistant"]
    try:
        with open(SAMPLE_JSONL, encoding="utf-8") as fh:
            for line in fh:
                if not line.strip():
                    continue
                row = json.loads(line)
                if "text" in row:
                    texts.append(str(row["text"]))
                for message in row.get("messages", ()):
                    texts.append(str(message["content"]))
        texts.extend(EXTRA_CORPUS.read_text(encoding="utf-8").splitlines())
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise BaseModelError(
            f"cannot read the bundled tokenizer corpus in {DATA_DIR}: {type(exc).__name__}",
            fix="reinstall cvm-tune (app/data/sample.jsonl and tokenizer_corpus.txt are package data)",
        ) from exc
    return texts


def _build_into(out: Path) -> None:
    """Write tokenizer + model files into the (empty) directory ``out``."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    transformers.utils.logging.disable_progress_bar()  # "Writing model shards" bar on stderr
    bpe = Tokenizer(models.BPE(unk_token=None))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(corpus_texts(), trainer=trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<pad>",
        model_max_length=256,
    )
    tok.chat_template = CHAT_TEMPLATE

    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
    )
    # A private generator state: fixed weights without disturbing the caller's global RNG for long.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = LlamaForCausalLM(cfg)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)


def build_tiny_model(out_dir: Path) -> None:
    """Build the tiny Llama + BPE tokenizer into ``out_dir`` (byte-identical on every call).

    The build happens in a temp directory next to ``out_dir`` that is fsynced and renamed into
    place, so ``out_dir`` is either absent or complete. A complete ``out_dir`` is left as is.

    Args:
        out_dir: Target model directory (created; its parent is created too).

    Raises:
        BaseModelError: ``out_dir`` exists but is not a complete build, or the build failed.
    """
    out_dir = Path(out_dir)
    if out_dir.exists():
        if is_complete(out_dir):
            return
        raise BaseModelError(
            f"base model directory {out_dir} exists but is incomplete (missing one of {', '.join(MODEL_FILES)})",
            fix=f"remove {out_dir} and run again; it is rebuilt locally",
        )
    set_offline_env()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.parent.glob(f".tmp-{out_dir.name}-*"):
        # Left by a killed build; a young one may belong to a concurrent builder, so keep it.
        if time.time() - stale.stat().st_mtime > 3600:
            shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{out_dir.name}-", dir=out_dir.parent))
    try:
        _build_into(tmp)
        # Only the expected files: a stray extra file would change the tree hash.
        extra = sorted(p.name for p in tmp.iterdir() if p.name not in MODEL_FILES)
        if extra or not is_complete(tmp):
            raise BaseModelError(
                f"tiny model build produced unexpected files {extra or 'or lacks some'}",
                fix="check the installed transformers/tokenizers versions against the lock file",
            )
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; files get one mode whatever the writer used
        for entry in tmp.iterdir():
            os.chmod(entry, 0o644)
        fsync_tree(tmp)
        try:
            os.rename(tmp, out_dir)
        except OSError:
            # A concurrent builder won the race: its directory is equally valid.
            if not is_complete(out_dir):
                raise
        fsync_dir(out_dir.parent)
        logger.info("built tiny base model in %s", out_dir)
    except BaseModelError:
        raise
    except OSError as exc:  # disk full / read-only volume: the output volume's state, not a training problem
        raise StateError(f"building the tiny base model under {out_dir.parent} failed: {exc.strerror or type(exc).__name__}",
                         fix="check free space and permissions on the output volume") from exc
    except Exception as exc:
        raise BaseModelError(
            f"building the tiny base model failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
            fix="check free space and permissions on the output volume",
        ) from exc
    finally:
        with contextlib.suppress(OSError):
            if tmp.exists():
                shutil.rmtree(tmp)
