"""emptyDir volumes as per-pod directories: the paths a container names under a mount are rewritten.

There is no mount namespace here, so a container that writes `/tmp/result.json` on an emptyDir mounted
at `/tmp` would write the host's `/tmp` (shared by every pod, and left over between runs). Instead each
emptyDir volume is a directory `<pod dir>/volumes/<name>` that all the pod's containers share and that
goes with the pod, and every command/args word and env value that names a path under the mount
(`/tmp`, `/tmp/x`, `--flag=/tmp/x`) is rewritten to it, except the program itself (`command[0]`, which
comes from the image: here the host, whose interpreter may live under /tmp). Other volume types stay ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any


def empty_dir_mounts(pod_spec: Mapping[str, Any], container: Mapping[str, Any], volumes_dir: Path) -> dict[str, Path]:
    """{mountPath: local directory} for the container's mounts of the pod's emptyDir volumes."""
    empty = {str(v.get("name")) for v in pod_spec.get("volumes") or [] if isinstance(v, Mapping) and "emptyDir" in v}
    mounts: dict[str, Path] = {}
    for mount in container.get("volumeMounts") or []:
        name, path = str(mount.get("name") or ""), str(mount.get("mountPath") or "")
        if name not in empty or not path.startswith("/") or path == "/":
            continue
        local = volumes_dir / name
        if mount.get("subPath"):
            local = local / str(mount["subPath"]).strip("/")
        mounts[path.rstrip("/")] = local
    return mounts


def rewrite_path(text: str, mounts: Mapping[str, Path]) -> str:
    """`text` with a leading mount path (or one after the first `=`) replaced by its local directory."""
    head, sep, value = text.partition("=") if text.startswith("-") else ("", "", text)
    for mount in sorted(mounts, key=len, reverse=True):
        if value == mount or value.startswith(mount + "/"):
            return f"{head}{sep}{mounts[mount]}{value[len(mount):]}"
    return text


def ensure_dirs(mounts: Mapping[str, Path]) -> None:
    for local in mounts.values():
        local.mkdir(parents=True, exist_ok=True)
