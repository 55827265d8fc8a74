"""The proxies the gateway is compared with: nginx (Debian's package) and the LiteLLM proxy (PyPI).

Both run as foreground children bound to 127.0.0.1 over the same fake-miner ports, configured as a
fair streaming proxy would be (no response buffering, keep-alive to upstreams, least-connections
balancing). Neither is a project dependency: :func:`install_nginx` uses apt-get and
:func:`install_litellm` makes its own venv under ``.bench/`` (ignored by git through a
``.bench/.gitignore`` written here), and only when the benchmark is run with ``--install``.

Example::

    if nginx_binary():
        with start_nginx([8091, 8092], workdir) as (child, port):
            ...  # POST http://127.0.0.1:{port}/v1/chat/completions
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

from .procs import Child, free_port, wait_port

REPO = Path(__file__).resolve().parents[2]
BENCH_DIR = REPO / ".bench"
LITELLM_VENV = BENCH_DIR / "litellm-venv"
LITELLM_INSTALL_CMD = f"python3 -m venv {LITELLM_VENV} && {LITELLM_VENV}/bin/pip install 'litellm[proxy]'"
NGINX_INSTALL_CMD = "apt-get update && apt-get install -y nginx"


def ensure_bench_dir() -> Path:
    BENCH_DIR.mkdir(exist_ok=True)
    ignore = BENCH_DIR / ".gitignore"
    if not ignore.exists():
        ignore.write_text("*\n")
    return BENCH_DIR


# -- nginx -----------------------------------------------------------------------------------------


def nginx_binary() -> str | None:
    return shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx",) if os.path.exists(p)), None)


def install_nginx() -> str | None:
    """``apt-get install -y nginx`` (needs root); the binary's path, or None when it could not be had."""
    if nginx_binary() is None and shutil.which("apt-get"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update", "-qq"], env=env, check=False)
        subprocess.run(["apt-get", "install", "-y", "-qq", "nginx"], env=env, check=False)
    return nginx_binary()


def nginx_conf(listen_port: int, upstream_ports: Sequence[int], workdir: Path) -> str:
    """A streaming reverse proxy: least_conn over the miners, proxy_buffering off, upstream keep-alive."""
    servers = "\n".join(f"    server 127.0.0.1:{p} max_fails=0;" for p in upstream_ports)
    temp = "\n".join(f"  {kind}_temp_path {workdir}/{kind};" for kind in ("client_body", "proxy", "fastcgi",
                                                                          "uwsgi", "scgi"))
    return f"""worker_processes 1;
daemon off;
pid {workdir}/nginx.pid;
error_log {workdir}/error.log warn;
events {{ worker_connections 4096; }}
http {{
  access_log off;
{temp}
  upstream miners {{
    least_conn;
{servers}
    keepalive 512;
  }}
  server {{
    listen 127.0.0.1:{listen_port} backlog=1024;
    location / {{
      proxy_pass http://miners;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_request_buffering off;
      proxy_read_timeout 300s;
    }}
  }}
}}
"""


@contextlib.contextmanager
def start_nginx(upstream_ports: Sequence[int], workdir: Path) -> Iterator[tuple[Child, int]]:
    binary = nginx_binary()
    if binary is None:
        raise RuntimeError(f"nginx is not installed ({NGINX_INSTALL_CMD}, or run with --install)")
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    conf = workdir / "nginx.conf"
    conf.write_text(nginx_conf(port, upstream_ports, workdir))
    child = Child([binary, "-c", str(conf), "-p", str(workdir), "-e", str(workdir / "error.log")], name="nginx",
                  log_path=workdir / "stderr.log")
    with child:
        wait_port(port, 15.0, child)
        yield child, port


# -- LiteLLM ---------------------------------------------------------------------------------------


def litellm_binary() -> Path | None:
    exe = LITELLM_VENV / "bin" / "litellm"
    return exe if exe.exists() else None


def install_litellm() -> Path | None:
    """Make ``.bench/litellm-venv`` with ``litellm[proxy]``; the CLI's path, or None when that failed."""
    if litellm_binary() is None:
        ensure_bench_dir()
        subprocess.run([sys.executable, "-m", "venv", str(LITELLM_VENV)], check=False)
        subprocess.run([str(LITELLM_VENV / "bin" / "pip"), "install", "-q", "litellm[proxy]"], check=False)
    return litellm_binary()


def litellm_config(upstream_ports: Sequence[int], master_key: str, model: str = "bench") -> str:
    """One model name over every miner as a deployment, least-busy routing, no retries or extras.

    LiteLLM refuses to start without a master key; clients send it as their bearer token, as they
    send an API key to the gateway.
    """
    deployments = "\n".join(
        f"""  - model_name: {model}
    litellm_params:
      model: openai/{model}
      api_base: http://127.0.0.1:{p}/v1
      api_key: sk-unused
      stream_timeout: 60""" for p in upstream_ports)
    return f"""model_list:
{deployments}
router_settings:
  routing_strategy: least-busy
  num_retries: 0
litellm_settings:
  telemetry: false
  drop_params: true
  num_retries: 0
  request_timeout: 60
general_settings:
  master_key: {master_key}
  disable_spend_logs: true
"""


@contextlib.contextmanager
def start_litellm(upstream_ports: Sequence[int], workdir: Path,
                  ready_timeout: float = 120.0) -> Iterator[tuple[Child, int, str]]:
    """The LiteLLM proxy (one uvicorn worker); yields the child, its port and the master key to send."""
    exe = litellm_binary()
    if exe is None:
        raise RuntimeError(f"LiteLLM is not installed ({LITELLM_INSTALL_CMD}, or run with --install)")
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    cfg = workdir / "litellm.yaml"
    master_key = "sk-" + secrets.token_hex(24)
    cfg.write_text(litellm_config(upstream_ports, master_key))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "LITELLM_", "DATABASE_URL"))}
    env.update({"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR", "NO_DOCS": "True",
                "LITELLM_TELEMETRY": "False", "PYTHONUNBUFFERED": "1"})
    child = Child([str(exe), "--config", str(cfg), "--host", "127.0.0.1", "--port", str(port), "--num_workers", "1"],
                  name="litellm", env=env, cwd=workdir, log_path=workdir / "litellm.log")
    with child:
        wait_port(port, ready_timeout, child)
        yield child, port, master_key
