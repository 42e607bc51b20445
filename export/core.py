"""`draftsmith export`: a checkpoint in the layout a serving stack loads.

Each drafter declares the formats it writes (`formats`, heads/formats.py: renaming rules, writer,
serving command); this module checks the checkpoint, the destination and the disk, then writes
what the drafter's writer returns.  docs/formats.md lists the formats per drafter.

Layer ids: draftsmith's are `hidden_states[i]`, the INPUT of decoder layer i.
vLLM reads the same convention; SGLang and TensorRT-LLM read "output of layer
i" (= our i+1), so their exports write i-1 (vLLM, SGLang and TensorRT-LLM loaders).  Every
export checks the tensor names and shapes against the format before writing,
writes the ids explicitly, and leaves a README.md with the serving command.
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
from pathlib import Path

import torch

from draftsmith.heads.drafter import checkpoint_target, read_config, read_weights, target_path
from draftsmith.heads.formats import ExportError, check_shapes, export_formats, formats_of, layout
from draftsmith.heads.infra.device import resolve_device
from draftsmith.heads.infra.files import (DirectoryLock, as_disk_full, current_umask, require_free_space,
                                          save_tensors, swap_directory)
from draftsmith.heads.infra.outputs import EXPORT_MARK, checkpoint_around, export_manifest, holds
from draftsmith.heads.runtime.target import TargetIdentity


def writable_formats(kind: str) -> list[str]:
    """The formats a checkpoint of `kind` exports to."""
    return [name for name, f in formats_of(kind).items() if f.write is not None]


def _dtype(name: str) -> torch.dtype:
    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[name]


def check_weights(weights: dict, config: dict, where: str) -> None:
    """The checkpoint holds exactly the tensors its drafter's declared layout names, in those shapes."""
    wrong = check_shapes(weights, layout(config))
    if wrong:
        raise ExportError(f"{where} does not hold the tensors its config describes: {wrong}; the checkpoint is "
                          "damaged or mixed up")


def export(checkpoint: str | Path, fmt: str, out_dir: str | Path, dtype: str = "bfloat16",
           overwrite: bool = False, target_path: str | None = None, device: str = "auto",
           with_target: bool = False, serving_report: str | Path | None = None) -> Path:
    """Write `checkpoint` in format `fmt` to `out_dir` (and with_target: the target, adapter merged, in
    out_dir/target); returns out_dir.  serving_report: a `draftsmith bench --engine vllm` report.json whose
    measured speculative_config the README carries."""
    checkpoint, out_dir = Path(checkpoint), Path(out_dir)
    if fmt not in export_formats():
        raise ExportError(f"unknown export format '{fmt}'; choose one of {', '.join(export_formats())}")
    config = read_config(checkpoint)
    kind = config["kind"]
    supported = writable_formats(kind)
    if fmt not in supported:
        raise ExportError(f"a {kind} drafter cannot be exported as '{fmt}': the formats for {kind} are "
                          f"{', '.join(supported) or 'none yet'}")
    writer = formats_of(kind)[fmt]
    weights = read_weights(checkpoint, config)
    check_weights(weights, config, str(checkpoint))
    check_destination(checkpoint, out_dir, overwrite)       # before the lock writes its file beside out_dir
    created = not out_dir.parent.exists()
    lock = DirectoryLock(out_dir.parent, "export", name=f".{out_dir.name}.export-lock", subject=out_dir)
    try:
        with lock:              # one export into a folder at a time (they share its temporary folder)
            _write(checkpoint, config, writer, weights, fmt, out_dir, dtype, overwrite, target_path, device,
                   with_target, serving_report)
    except BaseException:
        if created and out_dir.parent.is_dir() and {p.name for p in out_dir.parent.iterdir()} <= {lock.name}:
            (out_dir.parent / lock.name).unlink()
            out_dir.parent.rmdir()               # no empty folder left behind
        raise
    return out_dir


def _write(checkpoint: Path, config: dict, writer, weights: dict, fmt: str, out_dir: Path, dtype: str,
           overwrite: bool, target_path: str | None, device: str, with_target: bool, serving_report) -> None:
    """export()'s work, under the folder's lock (the destination checked again under it: the check before
    and the lock are not one step)."""
    check_destination(checkpoint, out_dir, overwrite)
    needed = writer.needs_target(config) or target_path or with_target
    target = _target_for(config, target_path, dtype, device, layers=with_target) if needed else None
    try:
        tensors, files = writer.write(config, weights, target, _dtype(dtype), checkpoint)
    except ExportError as err:
        raise ExportError(f"'{checkpoint}': {err}") from None
    if config.get("target_adapter") and "README.md" in files:
        files["README.md"] += adapter_note(config)
    if serving_report is not None and "README.md" in files:
        files["README.md"] += serving_note(serving_report, config, writer)
    tmp = out_dir.with_name(out_dir.name + ".tmp-export")
    shutil.rmtree(tmp, ignore_errors=True)
    size = sum(t.numel() * _dtype(dtype).itemsize for state in tensors.values() for t in state.values())
    if with_target:
        size += sum(p.numel() for p in target.model.parameters()) * _dtype(dtype).itemsize
    require_free_space(out_dir, size + (1 << 20), "the export", "or choose another directory for it")
    try:
        tmp.mkdir(parents=True)
        written = sorted({*files, *tensors, *(["target"] if with_target else [])})
        files = {**files, EXPORT_MARK: {"format": fmt, "checkpoint": str(checkpoint.resolve()), "dtype": dtype,
                                        "target": config["target"], "files": written}}
        for name, content in files.items():
            (tmp / name).write_text(content if isinstance(content, str) else json.dumps(content, indent=2) + "\n")
        for filename, state in tensors.items():
            save_tensors({k: v.contiguous() for k, v in state.items()}, tmp / filename, metadata={"format": "pt"})
        if with_target:             # base + adapter merged: a plain model any stack serves
            target.model.to(_dtype(dtype)).save_pretrained(tmp / "target", safe_serialization=True)
            target.tokenizer.save_pretrained(tmp / "target")
            if writer.stitch is not None:        # the drafter is a layer of the target itself (MTP)
                writer.stitch(tensors, tmp / "target")
            for weights_file in (tmp / "target").rglob("*.safetensors"):
                os.chmod(weights_file, 0o666 & ~current_umask())
        swap_directory(tmp, out_dir)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise as_disk_full(err, tmp, "the export", "free some space or choose another directory, then export "
                           "again (nothing was written)") from None


def serving_note(report_path: str | Path, config: dict, writer) -> str:
    """The README section with the speculative_config `bench --engine vllm` measured for this drafter."""
    try:
        report = json.loads(Path(report_path).read_text())
    except (OSError, ValueError) as err:
        raise ExportError(f"--serving-config {report_path}: cannot read it as a bench report.json ({err})") from None
    chosen = report.get("serving_config") if isinstance(report, dict) else None
    if not isinstance(chosen, dict):
        raise ExportError(f"--serving-config {report_path} holds no measured serving_config: give the report.json "
                          "that `draftsmith bench CHECKPOINT --engine vllm` writes")
    if report.get("kind") != config["kind"]:
        raise ExportError(f"--serving-config {report_path} measured a {report.get('kind')} drafter, not this "
                          f"{config['kind']} checkpoint: bench this checkpoint with --engine vllm")
    spec = _checked_spec(chosen, report_path, config, writer)
    why = chosen.get("why")
    if not isinstance(why, str) or not why.strip() or len(why) > 500:
        raise ExportError(f"--serving-config {report_path}: its serving_config has no 'why' sentence (a string "
                          "under 500 characters): give the report.json that `draftsmith bench --engine vllm` wrote")
    why = " ".join(why.split()).replace("`", "'")
    if not spec:
        body = "Speculation lost at every load level measured: serve the target without this drafter."
    else:
        body = ("```bash\nvllm serve TARGET_DIR --speculative-config "
                + shlex.quote(json.dumps({**spec, "model": "THIS_DIR"})) + "\n```")
    source = shlex.quote(str(report.get("checkpoint")))[:300].replace("`", "'")
    return f"""
## Serving config measured by draftsmith bench

From `{Path(report_path).name}` (vLLM, checkpoint `{source}`): {why}.

{body}
"""


SPEC_KEYS = {"method": str, "num_speculative_tokens": int, "parallel_drafting": bool, "draft_tensor_parallel_size": int,
             "prompt_lookup_max": int, "prompt_lookup_min": int}


def drafter_depth(config: dict) -> int:
    """The most tokens this drafter proposes in one step (its tree's depth, heads, unrolled steps or block)."""
    d = config.get("drafter") or {}
    tree = d.get("tree") or {}
    return max(int(tree.get("depth") or 0), int(d.get("num_heads") or 0), int(d.get("ttt_steps") or 0),
               int(d.get("block_size") or 1) - 1, 1)


def _check_schedule(schedule, where: str, depth: int) -> None:
    """[[first batch size, last, K or 0], ...]: ascending, positive, K from 0 to the drafter's depth."""
    ok = isinstance(schedule, list) and 0 < len(schedule) <= 64
    last = 0
    for entry in schedule if ok else ():
        ok = (isinstance(entry, list) and len(entry) == 3 and all(type(v) is int for v in entry)
              and entry[0] == last + 1 and entry[0] <= entry[1] <= 1 << 20 and 0 <= entry[2] <= depth)
        if not ok:
            break
        last = entry[1]
    if not ok:
        raise ExportError(f"{where}: num_speculative_tokens_per_batch_size is not a list of [first batch size, last, "
                          f"K] with ascending sizes from 1 and K from 0 to {depth}; the report was edited or damaged")


def _checked_spec(chosen: dict, report_path, config: dict, writer) -> dict:
    """The measured speculative_config, each value of a known key, type and range (K from 1 to the drafter's
    depth), or an error naming it."""
    spec = chosen.get("speculative_config")
    where = f"--serving-config {report_path}"
    if not isinstance(spec, dict):
        raise ExportError(f"{where}: its serving_config has no speculative_config object: give the report.json "
                          "that `draftsmith bench CHECKPOINT --engine vllm` wrote")
    for key, value in spec.items():
        if key == "num_speculative_tokens_per_batch_size":
            _check_schedule(value, where, drafter_depth(config))
            continue
        kind = SPEC_KEYS.get(key)
        if kind is None:
            raise ExportError(f"{where}: speculative_config has '{str(key)[:40]}', which draftsmith does not write; "
                              "the report was edited or is not a draftsmith bench report")
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ExportError(f"{where}: speculative_config's {key} is {str(value)[:40]!r}, not a {kind.__name__}")
    if spec and spec.get("method") != writer.method:
        raise ExportError(f"{where} measured vLLM's method {str(spec.get('method'))[:40]}, and a '{writer.name}' "
                          "export is not served with that speculative_config: export --to vllm")
    depth = drafter_depth(config)
    k = spec.get("num_speculative_tokens")
    if spec and (k is None or not 1 <= k <= depth):
        raise ExportError(f"{where}: num_speculative_tokens is {k}, outside 1..{depth} (this drafter proposes at "
                          "most that many tokens a step)")
    return dict(spec)


def adapter_note(config: dict) -> str:
    """How to serve a drafter trained against base + LoRA adapter: merged, or with vLLM's LoRA support."""
    base = target_path(config)
    adapter = config["target_adapter"]
    return f"""
## The target carries a LoRA adapter

This drafter was trained against `{base}` with the LoRA adapter `{adapter}` (sha256 prefix
`{config["target"].get("adapter_sha256", "")}`), not against the bare base: serve the adapted model, or
it drafts for the wrong distribution.

1. **Merged** (any serving stack, the base's speed): serve the merged model as the target with the
   speculative config above. `draftsmith export CHECKPOINT --to FORMAT OUT --with-target` writes it
   to `OUT/target`; or merge it yourself:

   ```python
   from peft import PeftModel
   from transformers import AutoModelForCausalLM
   base = AutoModelForCausalLM.from_pretrained("BASE_MODEL_DIR")
   PeftModel.from_pretrained(base, "{adapter}").merge_and_unload().save_pretrained("MERGED_DIR")
   ```

2. **vLLM with the LoRA enabled**: `vllm serve BASE_MODEL_DIR --enable-lora --lora-modules
   adapted={adapter} --speculative-config '...'`, and requests name `"model": "adapted"`. The
   adapter applies to the target only, never to the drafter. vLLM's V1 engine accepts LoRA together
   with speculative decoding on GPUs (vllm-project/vllm#21068); its feature matrix marks the pair as
   partly supported, with EAGLE-3 the tested method, and `ngram` with LoRA was reported to crash
   under concurrent requests (vllm-project/vllm#20284). Check acceptance on your own traffic
   (`draftsmith bench`) before relying on it.
"""


PROTECTED = ("config.json", "model.safetensors", "recipe.yaml", "data", "checkpoint", "manifest.json", "state")


def check_destination(checkpoint: Path, out_dir: Path, overwrite: bool) -> None:
    """An export never lands on (or around) the checkpoint, and --overwrite replaces only an earlier export."""
    dest = out_dir.resolve()
    if holds(dest, checkpoint.resolve()):
        raise ExportError(f"cannot export into '{out_dir}': it is (or contains) the checkpoint '{checkpoint}'; "
                          "choose a new directory for the export")
    if (around := checkpoint_around(dest)) is not None:
        raise ExportError(f"cannot export into '{out_dir}': it is inside the checkpoint '{around}', and an export "
                          "never writes into a checkpoint; choose a directory outside it")
    if not out_dir.exists() or not any(out_dir.iterdir()):
        return
    manifest, problem = export_manifest(out_dir)
    if problem:
        raise ExportError(f"'{out_dir}' is not empty and its export manifest is damaged ({problem}): --overwrite "
                          "replaces only a folder a draftsmith export wrote; move its files away or choose a new "
                          "directory")
    if manifest is None:
        held = sorted(name for name in PROTECTED if (out_dir / name).exists())
        raise ExportError(f"'{out_dir}' is not empty and is not an earlier draftsmith export"
                          + (f" (it holds {', '.join(held)})" if held else "")
                          + "; --overwrite only replaces an earlier export: choose a new or empty directory")
    if not overwrite:
        raise ExportError(f"'{out_dir}' holds an earlier export; pass --overwrite to replace it")
    foreign = not_written_by_export(out_dir, manifest)
    if foreign:
        raise ExportError(f"'{out_dir}' holds an earlier export and also {', '.join(foreign[:5])}"
                          + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
                          + ", which that export did not write; --overwrite replaces only what an export wrote: move "
                          "them out of the folder, or export into a new directory")


def not_written_by_export(out_dir: Path, manifest: dict) -> list[str]:
    """The entries of an export folder its export did not write: those its manifest lists are its own (an
    export made before the manifest listed them: any file, and the merged target's folder)."""
    listed = manifest.get("files")
    own = {EXPORT_MARK, *listed} if isinstance(listed, list) else None
    return sorted(p.name for p in out_dir.iterdir()
                  if not (p.name in own if own is not None else (p.is_file() or p.name == "target")))


def _target_for(config: dict, target_path: str | None, dtype: str, device: str, layers: bool = False):
    """The target, for its identity and the matrices an export carries: in bf16 on the resolved device
    for a bf16 export (no precision lost), in fp32 for fp32/fp16 exports.  Only its embedding and
    lm_head are read, unless the export writes the whole target (layers=True)."""
    load_dtype = "bfloat16" if dtype == "bfloat16" else "float32"
    target = checkpoint_target(config, load_dtype, resolve_device(device), target_path, layers=layers)
    TargetIdentity.from_dict(config["target"]).require_same(target.identity, "the checkpoint")
    return target
