"""The files of a checkpoint (:mod:`sbpjax.checkpoint`): its manifest, written
after a save, and the checks ``restore`` makes against it before reading
anything (a folder that is missing, a save that did not finish, a file whose
size or SHA-256 changed). Kept apart from the reading and writing of arrays,
which orbax does."""

from __future__ import annotations

import hashlib
import json
import os

from sbpjax._errors import SBPError

_TMP_SUFFIX = ".orbax-checkpoint-tmp"  # orbax's folder for a save in progress

_MANIFEST = "sbpjax_manifest.json"


class CheckpointError(SBPError):
    """A checkpoint that cannot be restored. ``kind``: ``"missing"``,
    ``"incomplete"`` or ``"corrupted"``; ``file``: the file at fault (None
    when it is the folder)."""

    def __init__(self, message: str, kind: str, file: str | None = None):
        super().__init__(message)
        self.kind, self.file = kind, file


def unfinished_saves(path: str) -> set:
    """orbax's temporary folders for saves to ``path`` that have not been renamed to it."""
    parent, base = os.path.split(path)
    if not os.path.isdir(parent):
        return set()
    return {e for e in os.listdir(parent) if e.startswith(base + _TMP_SUFFIX)}


# -- the manifest ---------------------------------------------------------------------


def _files(path: str) -> list[str]:
    out: list[str] = []
    for root, _, names in os.walk(path):
        out.extend(os.path.relpath(os.path.join(root, n), path) for n in names)
    return sorted(f for f in out if f != _MANIFEST)


def _sha256(file: str) -> str:
    h = hashlib.sha256()
    with open(file, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(path: str) -> None:
    """List every file of the checkpoint at ``path`` with its size and SHA-256."""
    entries = {
        f: {"size": os.path.getsize(os.path.join(path, f)), "sha256": _sha256(os.path.join(path, f))}
        for f in _files(path)
    }
    tmp = os.path.join(path, _MANIFEST + ".tmp")
    with open(tmp, "w") as fh:
        json.dump({"format": 1, "files": entries}, fh, indent=1, sort_keys=True)
    os.replace(tmp, os.path.join(path, _MANIFEST))  # the manifest appears whole or not at all


def check_present(path: str) -> None:
    """Raise CheckpointError unless ``path`` is a checkpoint folder whose files
    are those the save wrote (see the module docstring)."""
    if not os.path.exists(path):
        unfinished = sorted(unfinished_saves(path))
        if unfinished:
            raise CheckpointError(
                f"checkpoint.restore: the checkpoint at {path} is incomplete: a save to it did not finish "
                f"(it left {os.path.join(os.path.dirname(path), unfinished[0])}). Save it again, or restore an "
                "earlier checkpoint.",
                "incomplete",
                os.path.join(os.path.dirname(path), unfinished[0]),
            )
        raise CheckpointError(
            f"checkpoint.restore: no checkpoint at {path}. Check the path; a checkpoint is "
            "the folder that checkpoint.save(path, tree) created.",
            "missing",
        )
    if not os.path.isdir(path):
        raise CheckpointError(
            f"checkpoint.restore: {path} is a file, not a checkpoint folder; it is corrupted "
            "or not a checkpoint. A checkpoint is the folder checkpoint.save(path, tree) "
            "created.",
            "corrupted",
            path,
        )
    manifest = os.path.join(path, _MANIFEST)
    if not os.path.exists(manifest):
        return  # written by another tool: nothing to check against
    try:
        with open(manifest) as fh:
            entries = json.load(fh)["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(
            f"checkpoint.restore: the checkpoint at {path} is corrupted: its file list "
            f"{manifest} cannot be read ({e}).",
            "corrupted",
            manifest,
        ) from None
    for rel, info in sorted(entries.items()):
        file = os.path.join(path, rel)
        if not os.path.exists(file):
            raise CheckpointError(
                f"checkpoint.restore: the checkpoint at {path} is incomplete: {file} is missing (the save "
                "wrote it; it was removed or not copied). Copy the whole folder again, or restore an earlier "
                "checkpoint.",
                "incomplete",
                file,
            )
        size = os.path.getsize(file)
        if size != info["size"]:
            raise CheckpointError(
                f"checkpoint.restore: the checkpoint at {path} is corrupted: {file} has {size} bytes, the save "
                f"wrote {info['size']} ({'truncated' if size < info['size'] else 'overwritten'}). Restore an "
                "earlier checkpoint or copy this one again.",
                "corrupted",
                file,
            )
        if _sha256(file) != info["sha256"]:
            raise CheckpointError(
                f"checkpoint.restore: the checkpoint at {path} is corrupted: the contents of {file} changed "
                "since the save (its SHA-256 differs). Restore an earlier checkpoint or copy this one again.",
                "corrupted",
                file,
            )
