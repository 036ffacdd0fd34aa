"""Entry point of the `kvmesh` console script.

Each command group lives in its own module and registers itself here;
heavy imports (torch, nats) stay inside the commands so `kvmesh --help`
is fast.
"""

from __future__ import annotations

import typer

app = typer.Typer(
    name="kvmesh",
    help="KV-cache-centric LLM serving for agent workloads.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)



@app.callback()
def main() -> None:
    """KV-cache-centric LLM serving for agent workloads."""


# Command groups register below, one line each.


@app.command()
def version() -> None:
    """Print the kvmesh version."""
    from importlib.metadata import version as dist_version

    typer.echo(dist_version("kvmesh"))
from kvmesh.cli import model as _model; app.add_typer(_model.app, name="model")  # noqa: E402
from kvmesh.cli import stack as _stack; _stack.register(app)  # noqa: E402 - up, status, down
from kvmesh.cli import sim as _sim; app.command(name="sim")(_sim.sim)  # noqa: E402
from kvmesh.cli import generate as _generate; app.command(name="generate")(_generate.generate)  # noqa: E402
from kvmesh.cli import bench as _bench; app.add_typer(_bench.app, name="bench")  # noqa: E402
from kvmesh.cli import kv as _kv; app.add_typer(_kv.app, name="kv")  # noqa: E402
from kvmesh.cli import chat as _chat; app.command(name="chat")(_chat.chat)  # noqa: E402
from kvmesh.cli import chaos as _chaos; app.add_typer(_chaos.app, name="chaos")  # noqa: E402
from kvmesh.cli import trace as _trace; app.add_typer(_trace.app, name="trace")  # noqa: E402
from kvmesh.cli import report as _report; app.add_typer(_report.app, name="report")  # noqa: E402
