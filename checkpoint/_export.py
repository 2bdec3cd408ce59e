"""What ``consolidate`` needs to export a training run as a folder ``from_pretrained`` loads.

* ``checkpoint_folder``: the checkpoint to read, given a ``CheckpointManager``, a manager's
  root folder (its ``step-<n>`` folders; the latest committed step, or ``step``) or a
  checkpoint folder itself. Read-only: nothing is created or removed.
* ``config_files``: the model's ``config.json`` (and ``generation_config.json`` for a model
  that generates), from a transformers config, a transformers model, or a folder (or a
  ``config.json`` path) whose files are copied as they are (no transformers needed).
"""

from __future__ import annotations

import json
import os
import posixpath
from collections.abc import Mapping
from typing import Any

import fsspec

from ._schema import METADATA_FILE
from ._steps import check_step, committed_steps, step_name
from ._storage import is_local, resolve

__all__ = ["checkpoint_folder", "manager_step", "config_files", "ConfigLike"]

ConfigLike = Any  # a transformers PretrainedConfig or PreTrainedModel, or a path
_CONFIG = "config.json"
_GENERATION = "generation_config.json"


def checkpoint_folder(source: Any, step: int | None, storage_options: Mapping[str, Any] | None) -> str:
    """The checkpoint folder ``source`` designates (see the module docstring).

    Raises:
        ValueError: ``step`` given for a plain checkpoint folder, or a bad ``step``.
        FileNotFoundError: no committed step (or not ``step``) under a manager's root, or nothing
            at ``source``.
    """
    found = manager_step(source, step, storage_options)
    return str(os.fspath(source)) if found is None else found[0]


def manager_step(source: Any, step: int | None, storage_options: Mapping[str, Any] | None
                 ) -> tuple[str, int, list[int]] | None:
    """``(the chosen step's folder, that step, every committed step)`` when ``source`` is a
    ``CheckpointManager`` or its root; ``None`` when ``source`` is a checkpoint folder itself,
    or no manager's root (reading it then reports what is wrong).

    The steps are read by the manager's own rule (``_steps``); the latest is chosen when
    ``step`` is ``None``.

    Raises:
        ValueError: ``step`` given for a plain checkpoint folder, or a bad ``step``.
        FileNotFoundError: no committed step (or not ``step``) under a manager's root.
    """
    if step is not None:
        check_step(step)
    manager = getattr(source, "_root", None) is not None and hasattr(source, "latest_step")
    if manager:  # a CheckpointManager: its root, read like any other
        fs, root = source._fs, str(source._root)
    else:
        fs, root = resolve(source, storage_options)
        if fs.exists(posixpath.join(root, METADATA_FILE)):
            if step is not None:
                msg = (f"{os.fspath(source)!r} is one checkpoint, not a CheckpointManager's root; drop step={step} "
                       f"or give the manager's root folder.")
                raise ValueError(msg)
            return None
    steps = committed_steps(fs, root)
    if not steps and step is None and not manager:
        return None
    if not steps:
        msg = f"{root!r} holds no committed CheckpointManager step (step-<n>/{METADATA_FILE})."
        raise FileNotFoundError(msg)
    chosen = steps[-1] if step is None else step
    if chosen not in steps:
        msg = f"step {step} is not a committed step of the CheckpointManager at {root!r}; its steps: {steps}."
        raise FileNotFoundError(msg)
    path = posixpath.join(root, step_name(chosen))
    return (path if is_local(fs) else fs.unstrip_protocol(path)), chosen, steps


def config_files(config: ConfigLike) -> dict[str, bytes]:
    """File name -> bytes of the config files to write beside the weights.

    Raises:
        TypeError: ``config`` is none of a transformers config, model, or path.
        FileNotFoundError: a path without ``config.json``.
    """
    if isinstance(config, (str, os.PathLike)):
        return _copied(os.fspath(config))
    model = config if hasattr(config, "config") and hasattr(config, "can_generate") else None
    config = model.config if model is not None else config
    if not hasattr(config, "to_json_string") or not hasattr(config, "model_type"):
        msg = (f"config must be a transformers config (model.config), a transformers model, or a folder holding "
               f"config.json; got {type(config).__name__}.")
        raise TypeError(msg)
    data = json.loads(config.to_json_string(use_diff=False))
    if model is not None and not data.get("architectures"):
        data["architectures"] = [type(model).__name__]
    files = {_CONFIG: (json.dumps(data, indent=2, sort_keys=True) + "\n").encode()}
    generation = _generation_config(model, config, data.get("architectures"))
    if generation is not None:
        files[_GENERATION] = generation.to_json_string(use_diff=True).encode()
    return files


def _generation_config(model: Any, config: Any, architectures: list[str] | None) -> Any:
    """The generation config ``save_pretrained`` would write, or ``None`` for a model that does not generate."""
    if model is not None:
        return model.generation_config if model.can_generate() else None
    try:
        import transformers
        from transformers import GenerationConfig
    except ImportError:
        return None
    cls = getattr(transformers, architectures[0], None) if architectures else None
    if cls is not None and not cls.can_generate():
        return None
    generation = GenerationConfig.from_model_config(config)
    if cls is None and not set(generation.to_diff_dict()) - {"transformers_version"}:
        return None  # the model class is unknown and the config sets no generation value: nothing to say
    return generation


def _copied(path: str) -> dict[str, bytes]:
    fs, where = fsspec.core.url_to_fs(path)
    folder = posixpath.dirname(where) if where.endswith(".json") else where
    files = {}
    for name in (_CONFIG, _GENERATION):
        try:
            files[name] = fs.cat_file(posixpath.join(folder, name))
        except FileNotFoundError:
            continue
    if _CONFIG not in files:
        msg = f"config={path!r} holds no {_CONFIG}; give the pretrained model's folder or its {_CONFIG}."
        raise FileNotFoundError(msg)
    return files
