"""sglang-sim: a CPU-cheap stand-in for SGLang's native /generate server (see docs/simulator.md).

In-process:  `async with serve(SimConfig(time_scale=50), port=0) as sim: ... sim.url ...`
Subprocess:  `with SimProcess(["--time-scale", "50"]) as sim: ... sim.url ...`
"""
from sglang_sim.config import SimConfig
from sglang_sim.launch import SimProcess
from sglang_sim.server import SimServer, make_app, serve, start_server

__all__ = ["SimConfig", "SimProcess", "SimServer", "make_app", "serve", "start_server"]
