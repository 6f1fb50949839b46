"""configs/serve.yaml on a LocalCluster, deployed as users deploy it (`serve deploy` of a config
file), for the serving tests and bench/serve.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from harness.cluster import BUNDLE_ROOT, LocalCluster, free_port
from pipeline.serve.app import DEPLOYMENT

APP = "classifier"  # the application's name in configs/serve.yaml
REPLICA_CLASS = f"ServeReplica:{APP}:{DEPLOYMENT}"  # its replicas' actor class, as Ray lists it


def _serve_cli() -> str:
    return str(Path(sys.executable).with_name("serve"))


class ServeApp:
    """`ServeApp(cluster, tmp).deploy(model, args={...}, deployment={...})`: configs/serve.yaml
    with those changes to its application's args and deployment options, on a free port."""

    def __init__(self, cluster: LocalCluster, directory: Path):
        self.cluster, self.directory = cluster, directory
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/"
        self.deploys = 0

    def serve(self, *args: str, timeout_s: float = 120) -> str:
        """Output of the `serve` CLI against the cluster, e.g. serve("status")."""
        proc = subprocess.run(
            [_serve_cli(), *args, "--address", self.cluster.address],
            cwd=BUNDLE_ROOT,
            env=self.cluster.env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"serve {' '.join(args)} failed:\n{proc.stdout}{proc.stderr}")
        return proc.stdout

    def config(
        self,
        model: str | Path,
        args: dict[str, Any] | None = None,
        deployment: dict | None = None,
        http: dict | None = None,
        env: dict[str, str] | None = None,
    ) -> dict:
        """configs/serve.yaml for this cluster: `model`, `args`, `deployment` options, `http`
        options and the application's environment variables `env` set."""
        cfg = yaml.safe_load((BUNDLE_ROOT / "configs" / "serve.yaml").read_text())
        cfg["http_options"] |= {**(http or {}), "port": self.port}
        [app] = cfg["applications"]
        assert app["name"] == APP, app["name"]
        app["args"] |= {"model": str(model), **(args or {})}
        # The bundle, in place, as on a cluster whose nodes each hold it at one path.
        app["runtime_env"] = {"working_dir": f"local://{BUNDLE_ROOT}", "env_vars": env or {}}
        [options] = app["deployments"]
        assert options["name"] == DEPLOYMENT, options["name"]
        for key, value in (deployment or {}).items():
            options[key] = options[key] | value if isinstance(value, dict) else value
        return cfg

    def deploy(self, model: str | Path, **changes) -> None:
        """`serve deploy` of `config(model, **changes)`; returns once Serve took it (not once it
        runs). Serve takes `http` options at its first deploy on a cluster only."""
        self.deploys += 1
        path = self.directory / f"serve-{self.deploys}.yaml"
        path.write_text(yaml.safe_dump(self.config(model, **changes), sort_keys=False))
        self.serve("deploy", str(path))

    def status(self) -> dict:
        """The application's details, as `serve status` reads them from the dashboard's REST
        API ({} before it is deployed): status, message, deployments with their replicas.
        One HTTP request, where the CLI would start a Python process for each poll."""
        details = self.cluster.get("/api/serve/applications/", timeout_s=30)
        return (details.get("applications") or {}).get(APP, {})

    def replicas(self) -> list[dict]:
        """The replicas Serve holds: each with its state, actor_name and actor_id."""
        deployment = self.status().get("deployments", {}).get(DEPLOYMENT, {})
        return deployment.get("replicas", [])

    def running(self, replicas: int | None = None) -> bool:
        """Whether the application runs, every replica (or exactly `replicas`) running; raises
        with Serve's message when its deploy failed."""
        status = self.status()
        if status.get("status") == "DEPLOY_FAILED":
            raise RuntimeError(f"deploy failed: {status.get('message')}")
        deployment = status.get("deployments", {}).get(DEPLOYMENT, {})
        states = [r["state"] for r in deployment.get("replicas", [])]
        counts = len(states) == replicas if replicas else bool(states)
        return status.get("status") == "RUNNING" and counts and set(states) == {"RUNNING"}

    def kill_replica(self) -> tuple[str, float]:
        """`ray.kill` of one live replica actor, found through `ray.util.state.list_actors`,
        from a driver of its own; returns the actor's name and when it was killed
        (time.monotonic(), one clock for every process of this machine)."""
        script = (
            "import sys, time, ray\n"
            "from ray.util.state import list_actors\n"
            "ray.init(address=sys.argv[1])\n"
            f"filters = [('class_name', '=', {REPLICA_CLASS!r}), ('state', '=', 'ALIVE')]\n"
            "name = list_actors(address=sys.argv[2], filters=filters)[0].name\n"
            "ray.kill(ray.get_actor(name, namespace='serve'))\n"
            "print(name, time.monotonic())\n"
        )
        proc = subprocess.run(
            [sys.executable, "-c", script, self.cluster.gcs_address, self.cluster.address],
            env=self.cluster.env,
            capture_output=True,
            text=True,
            timeout=180,  # a driver's start on a loaded machine; the kill's moment is its own
        )
        if proc.returncode != 0:
            raise RuntimeError(f"could not kill a replica:\n{proc.stderr}")
        name, killed_at = proc.stdout.split()[-2:]
        return name, float(killed_at)

    def shutdown(self) -> None:
        self.serve("shutdown", "--yes")
