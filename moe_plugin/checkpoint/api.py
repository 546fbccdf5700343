"""``save_checkpoint``, ``load_checkpoint``, ``checkpoint_exists`` for ``DeepSpeedEngine`` (a ``GPTModel``)
and ``PipelineEngine`` (``pipeline.gpt_pipeline_module``).

Experts go into files by global id and the optimizer state into a layout-independent record (DeepSpeed's
MoE save path alone keeps data-parallel rank 0's experts only). A save is atomic; a load is checked
against the running model on every rank before anything is read into it, and fails on all ranks
alike. Every parallel size, the ZeRO stage and the model kind may change in between.
Design: docs/design/checkpoint_format.md.
"""
from __future__ import annotations

import contextlib
import copy
import json
import os
import pickle
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from moe_plugin.checkpoint.background import Capture, SaveWriter, capture_into, capturing
from moe_plugin.checkpoint.confine import inside, write_new
from moe_plugin.checkpoint.errors import CheckpointError, agree
from moe_plugin.checkpoint.expert_files import (
    expert_entries,
    experts_into_load,
    marker_without_local_experts,
    read_experts,
    write_expert_file,
    write_expert_files,
)
from moe_plugin.checkpoint.experts import expert_weights
from moe_plugin.checkpoint.files import (
    OLD_PREFIX,
    TMP_PREFIX,
    checksums,
    commit_tag,
    remove_stale,
    remove_stale_collective,
    verify,
    write_text,
)
from moe_plugin.checkpoint.keys import KIND_KEY, running_state
from moe_plugin.checkpoint.metadata import (
    EXPERT_DIR,
    LATEST,
    META_FILE,
    RNG_DIR,
    SAFE,
    TOKEN_LAYOUT_KEYS,
    check_fits,
    check_optimizer_can_follow,
    dense_recut,
    layout,
    metadata,
    module_files,
    read_latest,
    rng_file,
    saved_model_files,
    saved_stages,
)
from moe_plugin.checkpoint.optimizer import (
    RECORD_DIR,
    RECORD_KIND,
    dense_from_master,
    dense_record,
    load_record,
    match_record,
    record_file,
    record_kind,
)
from moe_plugin.checkpoint.plain_files import read_plain, write_plain
from moe_plugin.checkpoint.readers import deepspeed_header, materialize_all, open_module, open_record, record_weights
from moe_plugin.checkpoint.reshard import own_dense
from moe_plugin.checkpoint.rng import RNG_KIND, clear_pending_load, rng_state, set_rng_state
from moe_plugin.checkpoint.tags import check_keep_last, choose_tag, prune, saving
from moe_plugin.checkpoint.trust import trusted, trusting
from moe_plugin.compat.deepspeed_checkpoint import (
    is_optimizer_file,
    is_recovery_script,
    one_file_per_mp_rank,
    without_module_entries,
)
from moe_plugin.compat.deepspeed_checkpoint_engine import (
    checkpoint_engine,
    copying_recovery_scripts,
    intercepts,
    reading_safely,
    recording_checkpoint_engine,
)
from moe_plugin.compat.torch_files import unadmitted


# the metadata of an imported checkpoint that every checkpoint trained from it keeps (``hf_origin``)
ORIGIN_KEYS = ("architecture", "hf")
PLAIN_KINDS = {RNG_DIR: RNG_KIND, RECORD_DIR: RECORD_KIND}   # the folders of ``plain_files`` files in a tag


@dataclass(frozen=True)
class Owned:
    """Content made for this save (none of it training state): an asynchronous save does not copy it."""

    value: Any


def _write(obj: Any, path: str) -> None:
    """Write one file of ours whole (an asynchronous save's capture records it instead)."""
    owned = isinstance(obj, Owned)
    obj = obj.value if owned else obj
    capture = capturing()
    if capture is not None:
        capture.record(obj, path, _write, values_only=True, owned=owned)   # safetensors: values
        return
    folder = os.path.basename(os.path.dirname(path))
    if folder == EXPERT_DIR:
        write_expert_file(obj, path)
    elif folder in PLAIN_KINDS:
        write_plain(path, obj, PLAIN_KINDS[folder])
    else:
        raise ValueError(f"{path}: no file of this kind is written by a save")


def _write_bytes(data: bytes, path: str) -> None:
    """A file copied as it is (the tokenizer files of an imported model), captured like ``_write``."""
    capture = capturing()
    if capture is not None:
        capture.record(data, path, _write_bytes)
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_new(path, data)


# -- save ----------------------------------------------------------------------------------------
def save_checkpoint(run: Any, save_dir: os.PathLike | str, tag: Optional[str] = None,
                    client_state: Optional[dict] = None, save_latest: bool = True,
                    keep_last: Optional[int] = None, async_save: bool = False) -> str:
    """Save ``run`` (``moe_plugin.initialize``'s result) into ``save_dir/tag``; collective. Returns the
    tag's directory.

    The step boundary is applied first (``run.end_step()``). ``keep_last`` N: once committed, the tags
    beyond the newest N are removed. A write that fails on any rank is a ``CheckpointError`` on every
    rank naming ``save_dir``; nothing is committed. ``async_save``: the state is copied to host memory
    and written by a background thread (the same files); the directory exists once ``poll_save`` /
    ``wait_for_save`` returned it, and a failure is raised by those, on every rank at the same call.
    A save still in flight is waited for first."""
    check_keep_last(keep_last)
    found = unadmitted(client_state, "client_state")
    if found:   # DeepSpeed pickles it into its module file, which a load reads admitting plain data only
        raise CheckpointError(f"{found}; a checkpoint holds tensors and plain data only (dicts, lists, tuples, "
                              "str, numbers, bool, None), so that loading it runs no code; nothing was saved")
    wait_for_save(run)   # one save at a time; a failed one is raised here, on every rank
    if hasattr(run, "end_step"):
        run.end_step()
    engine = run.engine
    save_dir = os.fspath(save_dir)
    tag = _check_tag(f"global_step{engine.global_steps}" if tag is None else str(tag))
    tmp_tag = TMP_PREFIX + tag
    tmp_path = os.path.join(save_dir, tmp_tag)

    def prepare() -> None:
        if dist.get_rank() == 0:
            os.makedirs(save_dir, exist_ok=True)
            remove_stale(save_dir)  # what saves that died left (a link there refused)
            os.mkdir(tmp_path)      # new, never through a link: every file of the tag is written inside it
            for folder in (EXPERT_DIR, RNG_DIR, RECORD_DIR):
                os.mkdir(os.path.join(tmp_path, folder))

    saving(save_dir, tag, prepare)   # an unwritable directory: one error on every rank
    capture = Capture() if async_save else None
    # the optimizer record holds the optimizer state: DeepSpeed's files of it are not written (a
    # checkpoint engine that cannot be stood in for, such as a decoupled one, still writes them)
    once = record_kind(engine) is not None and intercepts(engine)
    with capture_into(capture), _deepspeed_files(engine, capture, once) as (refused, failed):
        engine.save_checkpoint(save_dir, tag=tmp_tag, client_state=client_state or {}, save_latest=False)
        saving(save_dir, tag, lambda: _deepspeed_files_written(refused, failed))
        meta = metadata(run, tag)
        meta.update(deepspeed_optimizer_files=not once, expert_files=SAFE)
        # an asynchronous save copies the experts to the host whole; a synchronous one writes them
        # layer by layer, each layer as its collectives make it (the peak holds one layer's)
        ours = expert_entries(run, tmp_path) if capture is not None else {}
        if capture is None:
            saving(save_dir, tag, lambda: write_expert_files(run, tmp_path))
        ours.update({os.path.join(tmp_path, name): entry for name, entry in dense_record(run).items()})
        origin = getattr(run, "hf_origin", None)
        if origin is not None:   # the loaded checkpoint came from import-hf: so does this one
            meta.update(copy.deepcopy(origin["record"]))

        def write_ours() -> None:
            for path, entry in ours.items():   # expert entries and the dense record: copies made for this save
                _write(Owned(entry), path)
            _write(rng_state(engine.module), rng_file(tmp_path, dist.get_rank()))
            for name, data in (origin or {}).get("files", {}).items():   # rank 0's only
                _write_bytes(data, os.path.join(tmp_path, name))

        saving(save_dir, tag, write_ours)  # every file is written (or a failure on any rank raised on all)

    def commit(group: Optional[dist.ProcessGroup] = None) -> None:
        if capture is not None:   # the files of the tag, in the background
            saving(save_dir, tag, capture.write_all, group)
        meta["files"] = checksums(tmp_path, group)

        def rename() -> None:
            if dist.get_rank() == 0:
                write_text(os.path.join(tmp_path, META_FILE), json.dumps(meta, indent=1))
                commit_tag(save_dir, tag, tmp_tag, save_latest)
                if keep_last is not None:
                    prune(save_dir, keep_last, tag)

        saving(save_dir, tag, rename, group)

    path = os.path.join(save_dir, tag)
    if capture is None:
        commit()
    else:
        _writer(run).start(tag, path, commit)
    return path


@contextlib.contextmanager
def _deepspeed_files(engine: Any, capture: Optional[Capture], once: bool) -> Iterator[tuple[list[str],
                                                                                          list[OSError]]]:
    """DeepSpeed's files, written by its checkpoint engine (or recorded into ``capture``) without what
    ours hold (``once``); yields (refused contents, failed writes) to raise after DeepSpeed's save."""
    refused: list[str] = []
    failed: list[OSError] = []
    if capture is None and not intercepts(engine):   # one that cannot be stood in for writes as it does
        yield refused, failed
        return
    inner = checkpoint_engine(engine)
    experts = {w.key for w in expert_weights(engine.module)} | dense_from_master(engine)
    checked = capture is not None or once

    def write(obj: Any, path: str) -> None:
        name = os.path.basename(path)
        if failed or (once and is_optimizer_file(name)):
            return
        found = unadmitted(obj, name) if checked else None
        if found:   # a load would refuse it (compat.torch_files.safe_load): not written, the save fails
            refused.append(found)
            return
        obj = without_module_entries(name, obj, experts) if once else obj
        if capture is not None:
            capture.record(obj, path, inner.save)
            return
        try:
            inner.save(obj, path)
        except OSError as err:
            failed.append(err)

    with recording_checkpoint_engine(engine, write), copying_recovery_scripts(engine, failed.append):
        yield refused, failed


def _deepspeed_files_written(refused: list[str], failed: list[OSError]) -> None:
    """Raise the first write of DeepSpeed's that failed, else the first file a load would refuse."""
    if failed:
        raise failed[0]
    if refused:
        raise CheckpointError(f"{refused[0]}, which a load would refuse (unpickling it could run code); this "
                              "DeepSpeed writes objects moe_plugin does not admit (compat.torch_files.DEEPSPEED_GLOBALS)")


def _writer(run: Any) -> SaveWriter:
    """The run's background writer (``run.saves``), made at its first asynchronous save."""
    if getattr(run, "saves", None) is None:
        run.saves = SaveWriter()
    return run.saves


def wait_for_save(run: Any) -> Optional[str]:
    """The directory of ``run``'s asynchronous save once committed (None without one); its failure a
    ``CheckpointError``, the same on every rank. Not collective; call it before the process ends."""
    saves = getattr(run, "saves", None)
    return saves.wait() if saves is not None else None


def poll_save(run: Any) -> Optional[str]:
    """Collective, e.g. after every step: the committed tag's directory once every writer is done (or
    its failure, on every rank); None while writing, or without a save in flight (no collective then)."""
    saves = getattr(run, "saves", None)
    return saves.poll() if saves is not None else None


def _check_tag(tag: str) -> str:
    if not tag or tag.startswith(".") or os.sep in tag or tag == LATEST:
        raise CheckpointError(f"tag: got {tag!r}; expected a plain directory name (no '{os.sep}', not starting "
                              f"with '.', not {LATEST!r})")
    return tag


# -- load ----------------------------------------------------------------------------------------
def checkpoint_exists(load_dir: os.PathLike | str) -> bool:
    """Whether ``load_dir`` holds a committed checkpoint (a ``latest`` file); collective.

    False for a missing or empty directory (or one holding only what an interrupted first save left).
    A directory with other entries but no ``latest`` raises ``CheckpointError``: starting from scratch
    there would hide a lost checkpoint."""
    load_dir = os.fspath(load_dir)

    def look() -> bool:
        if not os.path.isdir(load_dir):
            if os.path.exists(load_dir):
                raise CheckpointError(f"{load_dir}: not a directory")
            return False
        entries = sorted(e for e in os.listdir(load_dir) if not e.startswith((TMP_PREFIX, OLD_PREFIX))
                         and not is_recovery_script(e))
        if LATEST in entries:
            return True
        if entries:
            raise CheckpointError(f"{os.path.join(load_dir, LATEST)}: missing, but {load_dir} holds {entries[:4]}; "
                                  "no checkpoint was committed there (a tag without 'latest' is not loaded "
                                  "silently: pass its tag, or use an empty directory to start from scratch)")
        return False

    return agree(look)


def load_checkpoint(run: Any, load_dir: os.PathLike | str, tag: Optional[str] = None, *, strict: bool = False,
                    load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                    load_module_only: bool = False, load_rng_states: bool = True,
                    trust: bool = False) -> tuple[str, dict]:
    """Load ``load_dir/tag`` (default: the ``latest`` tag) into ``run``; collective. Returns
    DeepSpeed's ``(load_path, client_state)``.

    Raises ``CheckpointError`` on every rank, before the model changes, when the checkpoint does not
    fit the model. RNG states come back when every rank sees the tokens it saw when saving (same world
    size, tp, dp, pp and order). ``fresh_states`` of the metadata are never loaded. Without ``tag``, a
    ``latest`` tag that fails verification falls back to the newest tag that verifies; ``strict=True``
    raises instead. ``trust=True`` reads pickles as torch does (runs what they name): only for
    checkpoints whose every writer you trust."""
    with trusting(trust):
        return _load_checkpoint(run, load_dir, tag, strict, load_optimizer_states, load_lr_scheduler_states,
                                load_module_only, load_rng_states)


def _load_checkpoint(run: Any, load_dir: os.PathLike | str, tag: Optional[str], strict: bool,
                     load_optimizer_states: bool, load_lr_scheduler_states: bool, load_module_only: bool,
                     load_rng_states: bool) -> tuple[str, dict]:
    wait_for_save(run)   # a save in flight is committed (or its failure raised) before anything is read
    engine, groups = run.engine, run.groups
    load_dir = os.fspath(load_dir)
    remove_stale_collective(load_dir)
    tag, verified = choose_tag(load_dir, tag, strict)
    path = os.path.join(load_dir, tag)
    meta = agree(lambda: check_fits(run, path, tag))
    if not verified:
        verify(path, meta)   # every file against its checksum, before anything is read
    origin = agree(lambda: hf_origin(path, meta))
    # the optimizer state comes from the record (not DeepSpeed's files) after a layout change, and
    # always when the save wrote DeepSpeed's optimizer files no more (it then holds it once)
    resharded = (meta["layout"] != layout(groups) or meta["zero_stage"] != engine.zero_optimization_stage()
                 or KIND_KEY in meta or not meta.get("deepspeed_optimizer_files", True))
    fresh = meta.get("fresh_states", [])   # what an upcycled checkpoint does not hold (upcycle.py)
    optimizer_follows = load_optimizer_states and not load_module_only and "optimizer" not in fresh
    load_lr_scheduler_states = load_lr_scheduler_states and "lr_scheduler" not in fresh
    recut_optimizer = False
    if resharded and optimizer_follows:
        agree(lambda: check_optimizer_can_follow(run, meta))
        recut_optimizer = True
    experts, expert_moments = agree(lambda: read_experts(run, path, meta, recut_optimizer))
    same_token_groups = all(meta["layout"][k] == layout(groups)[k] for k in TOKEN_LAYOUT_KEYS)
    rng = agree(lambda: read_rng(path, dist.get_rank()) if load_rng_states and same_token_groups else None)
    recut = dense_recut(meta, groups)
    if recut:
        dense, header = agree(lambda: recut_dense(run, path, meta))
    else:   # the saved layout: only the dense weights DeepSpeed's module file left out
        agree(lambda: check_own_module(run, path, meta))   # before DeepSpeed reads and casts it
        dense, header = agree(lambda: own_record_weights(run, path)), {}
    optimizer_state = (agree(lambda: match_record(run, path, *read_record(run, path, meta), expert_moments))
                       if recut_optimizer else None)   # the record: the one state that follows a change

    with marker_without_local_experts(engine.module), experts_into_load(engine.module, {**dense, **experts}), \
            (contextlib.nullcontext() if trusted() else reading_safely(engine)), \
            (one_file_per_mp_rank(load_dir, tag, engine, {**header, "module": dense}) if recut
             else contextlib.nullcontext(load_dir)) as source:
        try:
            load_path, client_state = engine.load_checkpoint(
                source, tag, load_module_strict=True, load_optimizer_states=optimizer_follows and not resharded,
                load_lr_scheduler_states=load_lr_scheduler_states, load_module_only=load_module_only)
        except (EOFError, OSError, RuntimeError, pickle.UnpicklingError) as exc:  # unverified checkpoints only
            raise CheckpointError(f"{path}: DeepSpeed could not read its files ({type(exc).__name__}: {exc})") from exc
        if load_path is not None and recut:
            load_path = os.path.join(path, os.path.basename(load_path))
    if load_path is None:
        raise CheckpointError(f"{path}: DeepSpeed found no model states to load")
    _check_experts_loaded(engine.module, experts, path)
    if optimizer_state is not None:
        load_record(run, path, optimizer_state)
    if rng is not None:
        set_rng_state(engine.module, rng)
    else:
        clear_pending_load(engine.module)   # what this run's forwards counted before the load
    if getattr(run, "step_boundary", None) is not None:
        run.step_boundary.restart()   # the next forward starts the loaded run's step
    run.hf_origin = origin
    dist.barrier()
    return load_path, client_state


def read_rng(path: str, rank: int) -> Optional[dict]:
    """``rank``'s random streams in tag ``path``, or None when it has none."""
    file = rng_file(path, rank)
    return read_plain(file, RNG_KIND) if os.path.isfile(file) else None


def hf_origin(path: str, meta: dict) -> Optional[dict]:
    """What a checkpoint of ``import-hf`` hands on to every save of the run that loads it ({"record",
    "files": tokenizer files}); None for other checkpoints."""
    if "hf" not in meta:
        return None
    record = {key: meta[key] for key in ORIGIN_KEYS if key in meta}
    files = {}
    if dist.get_rank() == 0:
        for name in meta["hf"].get("tokenizer_files", []):
            with open(inside(path, name, os.path.join(path, META_FILE) + ": hf.tokenizer_files"), "rb") as f:
                files[name] = f.read()
    return {"record": record, "files": files}


def recut_dense(run: Any, path: str, meta: dict) -> tuple[dict, dict]:
    """This rank's dense entries cut for the running layout from every saved TP rank (and stage), key
    by key, and the rest of the first DeepSpeed file."""
    pieces: dict[str, list] = {}
    header = None
    for stage in saved_stages(meta, run.groups):
        modules = [running_state(meta, open_module(path, meta, stage, r))
                   for r in range(len(module_files(path, meta, stage)))]
        for key in modules[0]:
            pieces[key] = [m.get(key) for m in modules]
        if header is None:
            header = deepspeed_header(saved_model_files(path, meta, stage)[0])
    dense = own_dense(pieces, run.engine.module, run.groups.layout, dist.get_rank())
    return dense, header


def check_own_module(run: Any, path: str, meta: dict) -> None:
    """This rank's module file at the saved layout, checked against the metadata."""
    coords = run.groups.layout.coords(dist.get_rank())
    open_module(path, meta, coords["pp"], coords["tp"])


def own_record_weights(run: Any, path: str) -> dict:
    """At the saved layout: the dense weights DeepSpeed's file left out, from the optimizer record."""
    coords = run.groups.layout.coords(dist.get_rank())
    return {k: v.read() for k, v in record_weights(path, coords["pp"], coords["tp"]).items()}


def read_record(run: Any, path: str, meta: dict) -> tuple[dict, list[str], dict, list[dict]]:
    """This rank's dense optimizer state cut as ``recut_dense`` cuts the weights: ({state name: {key:
    tensor}}, state names, scalars, param groups' options)."""
    model, groups = run.engine.module, run.groups
    records = [[_record(path, stage, r) for r in range(meta["layout"]["tp"])] for stage in saved_stages(meta, groups)]
    first = records[0][0]
    names, scalars = first["names"], materialize_all(first["scalars"])
    out = {}
    for name in names:
        pieces: dict[str, list] = {}
        for files in records:
            states = [running_state(meta, {k: v[name] for k, v in f["state"].items()}) for f in files]
            pieces.update({key: [s[key] for s in states] for key in states[0]})
        out[name] = own_dense(pieces, model, groups.layout, dist.get_rank())
    return out, names, scalars, materialize_all(first["options"])


def _record(path: str, stage: int, tp_rank: int) -> dict:
    content = open_record(path, stage, tp_rank)
    if content is None:
        raise CheckpointError(f"{os.path.join(path, record_file(stage, tp_rank))}: missing (the metadata says the "
                              "save wrote the optimizer record)")
    return content


def _check_experts_loaded(model: nn.Module, experts: dict, path: str) -> None:
    """The module holds our experts, not DeepSpeed's file's (a load other than ``load_state_dict``)."""
    state = model.state_dict()
    wrong = [k for k, v in experts.items() if not torch.equal(state[k], v.to(state[k].dtype))]
    if wrong:
        raise RuntimeError(f"{path}: DeepSpeed's load left other values in the experts {wrong[:4]}; this DeepSpeed "
                           "version loads the module without load_state_dict (unsupported)")
