"""Checkpoints: written atomically, read without unpickling anything but data.

Atomic: ``save_checkpoint`` writes to a temporary file in the same directory,
fsyncs it, and renames it onto the final name with ``os.replace``; rename is
atomic within one file system (POSIX rename(2)), so a crash at any moment
leaves either the previous checkpoint or the new one under that name, never
half of one. The directory is fsynced afterwards so the rename itself survives
a power cut (the pattern ext4's documentation recommends; see also
"Files are hard", Pillai et al., OSDI 2014).

Safe to read: ``load_checkpoint`` uses ``torch.load(weights_only=True)``, whose
unpickler only rebuilds tensors, dicts (ordered too), lists, tuples, strings,
numbers, booleans and None, so a checkpoint from somewhere else cannot run
code. The state saved must therefore hold only those: model and optimizer
``state_dict()``s qualify; a model object, a numpy array or a lambda does not,
and ``save_checkpoint`` refuses them at once rather than leaving a file that
only fails on resume.

The state carries a format marker (FORMAT) and the task's ``config`` (the
JSON description of the architecture), so resuming with another model fails
with a message instead of a shape error from ``load_state_dict``.
"""
import json
import os
import secrets

import torch

FORMAT = "paratrain-checkpoint-1"
_PLAIN = (str, int, float, bool, type(None), torch.dtype, torch.device)


def _check_plain(obj, where="state"):
    """Raise TypeError, naming the entry, for anything weights_only loading would refuse."""
    if isinstance(obj, torch.Tensor) or isinstance(obj, _PLAIN):
        return
    if isinstance(obj, dict):
        for k, v in obj.items():
            if not isinstance(k, (str, int)):
                raise TypeError(f"{where}: checkpoint keys must be strings or ints, got {type(k).__name__}")
            _check_plain(v, f"{where}[{k!r}]")
        return
    if isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _check_plain(v, f"{where}[{i}]")
        return
    raise TypeError(f"{where} is a {type(obj).__name__}; a checkpoint may only hold tensors, dicts, lists, "
                    "tuples, strings, numbers, booleans and None (e.g. model.state_dict(), "
                    "optimizer.state_dict()), so it can be read back with torch.load(weights_only=True)")


def _fsync_dir(directory):
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return  # some file systems do not open directories; the rename is still atomic
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def save_checkpoint(path, state):
    """Write state (a dict with a "config" entry) to path atomically.

    The caller's dict is not changed; the file also gets {"format": FORMAT}."""
    if not isinstance(state, dict) or "config" not in state:
        raise ValueError("a checkpoint state is a dict with a 'config' entry (the task's config), "
                         "so a resume can check it builds the same model")
    state = {**state, "format": FORMAT}
    _check_plain(state)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    # Our own O_EXCL name rather than mkstemp: mkstemp creates the file 0600,
    # and the rename would give the checkpoint that mode instead of the umask's.
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(directory)


def _canonical(config):
    """Compare configs as JSON: a tuple saved is a list loaded, and that is no difference."""
    return json.loads(json.dumps(config, sort_keys=True, default=str))


def _describe(config, keys):
    """'mlp (model='MLP', sizes=[784, 10])': the name, then only the settings that differ."""
    name = config.get("name") or config.get("model") or "?"
    parts = [f"{k}={config[k]!r}" for k in keys if k in config]
    return f"{name} ({', '.join(parts)})" if parts else str(name)


def _mismatch(path, saved, expected):
    if not isinstance(saved, dict) or not isinstance(expected, dict):
        return f"checkpoint {path} was saved with config {saved!r}, but this run builds {expected!r}"
    differ = sorted(k for k in set(saved) | set(expected)
                    if k != "name" and saved.get(k, object()) != expected.get(k, object()))
    saved_name = saved.get("name") or saved.get("model") or "?"
    expected_name = expected.get("name") or expected.get("model") or "?"
    if saved_name != expected_name:
        return (f"checkpoint {path} was saved by model {_describe(saved, differ)}; this run builds "
                f"{_describe(expected, differ)}; pass --model {saved_name} to resume it, or another checkpoint")
    return (f"checkpoint {path} was saved by model {_describe(saved, differ)}, but this version of "
            f"paratrain builds {_describe(expected, differ)}: the model's architecture changed since, "
            "so this checkpoint cannot be resumed; start a new run")


def load_checkpoint(path, expect_config):
    """The state saved at path, after checking it is a paratrain checkpoint of
    the model this run builds (state["config"] == expect_config).

    FileNotFoundError if there is no file; ValueError, saying why, if the file is
    not a paratrain checkpoint, is damaged, or holds another model. Tensors are
    loaded onto the CPU."""
    path = os.fspath(path)
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "checkpoint.pt")):
        path = os.path.join(path, "checkpoint.pt")  # a run directory: its checkpoint
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no checkpoint at {path}; a run saves its checkpoint as "
                                "runs/<id>/checkpoint.pt")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch raises many kinds for a bad file (zip, pickle, EOF)
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ValueError(f"{path} is not a paratrain checkpoint, or it is damaged "
                         f"(torch.load: {type(e).__name__}: {first[:200]})") from None
    fmt = state.get("format") if isinstance(state, dict) else None
    if fmt != FORMAT:
        if isinstance(fmt, str) and fmt.startswith("paratrain-checkpoint-"):
            raise ValueError(f"{path} is a checkpoint in format {fmt}; this version of paratrain reads {FORMAT}")
        raise ValueError(f"{path} is not a paratrain checkpoint (no {FORMAT!r} marker); "
                         "it may be a plain torch.save file")
    if "config" not in state:
        raise ValueError(f"{path} is damaged: it has no 'config' entry")
    if _canonical(state["config"]) != _canonical(expect_config):
        raise ValueError(_mismatch(path, state["config"], expect_config))
    return state
