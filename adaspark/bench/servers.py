"""The arms a bench runs and the servers behind them.

An arm is either one of our engine's arms (`ar`, `chain3`, `tree:16`, `adaspark`, ...), served by
an `adaspark serve` subprocess that the harness starts and stops, or an external server that the
harness only attaches to (`--url NAME=URL`, e.g. llama.cpp's server).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from adaspark.bench.client import ChatClient
from adaspark.errors import UserError
from adaspark.scheduler.arm import Arm

ADASPARK = "adaspark"
SECOND_RUN = "#2"  # label suffix of AdaSpark's second run (after the pinned arms)


@dataclass(frozen=True)
class ArmRun:
    label: str  # what results and tables call it: "adaspark", "adaspark#2", "llamacpp"
    arm: str | None  # our server's --arm; None for an external server
    url: str | None = None

    @property
    def file_stem(self) -> str:
        return file_stem(self.label)


def file_stem(label: str) -> str:
    """An arm label as a file name, one per label: `adaspark:8` -> `adaspark_w8`,
    `adaspark#2` -> `adaspark_run`, `adaspark+plain` -> `adaspark_plain` (so `adaspark:2` and
    `adaspark#2` never share a store, log or round-log folder)."""
    label = label.replace(":", "_w").replace(SECOND_RUN, "_run").replace("+", "_")
    return re.sub(r"[^A-Za-z0-9._-]", "_", label)


def parse_external(specs: list[str]) -> dict[str, str]:
    """`NAME=URL` pairs from --url; a bare URL is named 'external'."""
    out: dict[str, str] = {}
    for spec in specs:
        name, sep, url = spec.partition("=")
        if not sep:
            name, url = "external", spec
        if not name or not url.startswith(("http://", "https://")):
            raise UserError(f"--url {spec!r}: expected NAME=http://HOST:PORT")
        if _arm_error(name) is None or name in out:
            raise UserError(f"--url {spec!r}: name {name!r} is taken; pick another")
        out[name] = url
    return out


def plan_arms(
    arms: list[str], external: dict[str, str], repeat_adaspark: bool = True
) -> list[ArmRun]:
    """The paper's order: AdaSpark first, every other arm, then AdaSpark again (§3.4, §4.1).

    External arms run where --arms names them, or after the listed arms if it does not. An
    explicit `adaspark#2` in --arms keeps the given order untouched; `ARM#2` runs any of our arms
    a second time under its own label and store.
    """
    names = [a for a in arms if a]
    names += [n for n in external if n not in names]
    for name in names:
        base = name.removesuffix(SECOND_RUN)
        if name not in external:
            _check_arm(name, base)
    if len(set(names)) != len(names):
        raise UserError(f"an arm is listed twice in {','.join(names)}")
    explicit_second = any(n.endswith(SECOND_RUN) for n in names)
    if ADASPARK in names and not explicit_second and len(names) > 1:
        names.remove(ADASPARK)
        names = [ADASPARK, *names] + ([ADASPARK + SECOND_RUN] if repeat_adaspark else [])
    runs = []
    for name in names:
        if name in external:
            runs.append(ArmRun(label=name, arm=None, url=external[name]))
        else:
            runs.append(ArmRun(label=name, arm=name.removesuffix(SECOND_RUN).replace("+", ",")))
    return runs


def _arm_error(name: str) -> UserError | None:
    """Why `name` is none of our arms (Arm.parse's error: its modifiers joined by '+', as in
    `adaspark+plain`, since commas already separate the arms of --arms), or None when it is."""
    try:
        Arm.parse(name)
    except UserError as err:
        return err
    return None


def _check_arm(name: str, base: str) -> None:
    """`base` (`name` without SECOND_RUN) is one of our arms; else a UserError naming what it
    takes."""
    if (err := _arm_error(base)) is not None:
        raise UserError(f"unknown arm {name!r} ({err}; modifiers joined with '+': "
                        "adaspark+plain), or name an external server with --url NAME=URL")


def _die_with_parent() -> None:
    """In the child before exec: Linux sends it SIGTERM if the bench is killed (even -9)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: a killed bench may leave its server running


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server command in a subprocess on `port`: started, waited for (/health 200), stopped.
    Ours (LocalServer) or another engine's (benchmarks/llama_server.py)."""

    def __init__(self, command: list[str], port: int, log_path: Path,
                 health_timeout_s: float = 600.0):
        self.port = port
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.health_timeout_s = health_timeout_s
        self.forward: str | None = None  # what /health says the server's target runs
        self.command = list(command)
        self._process: subprocess.Popen | None = None

    def __enter__(self) -> ServerProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"$ {' '.join(self.command)}\n".encode())
            log.flush()
            # own session, so stopping it also stops anything it spawned
            self._process = subprocess.Popen(
                self.command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def alive(self) -> bool:
        return self._process is not None and self._process.poll() is None

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.health_timeout_s
        with ChatClient(self.url) as client:
            while time.monotonic() < deadline:
                if not self.alive():
                    raise UserError(
                        f"the server exited with {self._process.returncode} before it was ready; "
                        f"its log: {self.log_path}\n{self.log_tail()}"
                    )
                status, body = client.health()
                if status == 200:
                    try:
                        self.forward = json.loads(body).get("forward")
                    except (ValueError, AttributeError):
                        self.forward = None
                    return
                if status is not None and status >= 500 and status != 503:  # 503: still loading
                    raise UserError(f"the server reports {status} on /health: {body}; "
                                    f"its log: {self.log_path}")
                time.sleep(0.5)
        raise UserError(f"the server was not healthy after {self.health_timeout_s:.0f} s; "
                        f"its log: {self.log_path}")

    def log_tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        try:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        except ProcessLookupError:
            pass


class LocalServer(ServerProcess):
    """`adaspark serve --arm ARM` in a subprocess."""

    def __init__(
        self,
        arm: str,
        log_path: Path,
        store: Path,
        fresh: bool,
        round_log: Path | None,
        extra_args: list[str] = (),
        health_timeout_s: float = 600.0,
    ):
        port = free_port()
        command = [sys.executable, "-m", "adaspark.cli", "serve", "--arm", arm]
        command += ["--host", "127.0.0.1", "--port", str(port), "--store", str(store)]
        if fresh:
            command.append("--fresh")
        if round_log is not None:
            command += ["--round-log", str(round_log)]
        super().__init__(command + list(extra_args), port, log_path, health_timeout_s)
