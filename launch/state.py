"""Where deployments live on disk: $FASTGEN_HOME (or ~/.fastgen)/<name>/ holds

    config.json   the settings `start` was given (written by the CLI)
    state.json    the supervisor's view: status, pids, restarts (written by the supervisor only)
    stop.json     a stop request's drain timeout (written by `stop` just before it signals the supervisor)
    restart.json  a restart request (written by `restart`; the supervisor takes it and reports in state.json)
    lock          flock-ed by the live supervisor for its whole life: the one source of truth for "is it running"
    logs/         one log per process, kept after `stop`

and $FASTGEN_HOME/_prometheus/<name>.json holds the Prometheus file_sd targets of its /metrics endpoints, from
`start` until `stop` (one folder for all deployments: Prometheus globs only a path's last element; no deployment
name starts with "_").

Every JSON file is written atomically (temporary file + rename), so readers never see half a file.
"""

from __future__ import annotations

import fcntl
import json
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from .config import DeployConfig


@dataclass(frozen=True)
class Paths:
    root: Path

    @property
    def config(self) -> Path:
        return self.root / "config.json"

    @property
    def state(self) -> Path:
        return self.root / "state.json"

    @property
    def stop_request(self) -> Path:
        return self.root / "stop.json"

    @property
    def restart_request(self) -> Path:
        return self.root / "restart.json"

    @property
    def lock(self) -> Path:
        return self.root / "lock"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def prometheus_targets(self) -> Path:
        return prometheus_targets_dir(self.root.parent) / f"{self.root.name}.json"

    def log(self, process_id: str) -> Path:
        return self.logs / f"{process_id}.log"


def prometheus_targets_dir(home: Path) -> Path:
    return home / "_prometheus"


def fastgen_home() -> Path:
    return Path(os.environ.get("FASTGEN_HOME") or Path.home() / ".fastgen").expanduser()


def paths_for(home: Path, name: str) -> Paths:
    return Paths(home / name)


def write_json_atomic(path: Path, data: dict | list) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None


def save_config(paths: Paths, config: DeployConfig) -> None:
    write_json_atomic(paths.config, asdict(config))


def load_config(paths: Paths) -> DeployConfig | None:
    data = read_json(paths.config)
    return None if data is None else DeployConfig(**data)


def try_lock(paths: Paths) -> int | None:
    """An fd holding the deployment's lock, or None when a live supervisor holds it."""
    paths.root.mkdir(parents=True, exist_ok=True)
    fd = os.open(paths.lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def is_live(paths: Paths) -> bool:
    """True while the deployment's supervisor runs (it holds the lock)."""
    if not paths.lock.exists():
        return False
    fd = try_lock(paths)
    if fd is None:
        return True
    os.close(fd)
    return False


def deployment_names(home: Path) -> list[str]:
    """Deployments that were started and not stopped (live or crashed)."""
    if not home.is_dir():
        return []
    return sorted(p.name for p in home.iterdir() if (p / "config.json").is_file())


def remove_live_state(paths: Paths) -> None:
    """Forget a stopped deployment (Prometheus stops scraping it too); its logs stay for `fastgen-deploy logs`."""
    for path in (paths.state, paths.config, paths.stop_request, paths.restart_request, paths.prometheus_targets):
        path.unlink(missing_ok=True)
