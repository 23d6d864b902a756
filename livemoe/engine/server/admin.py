"""The routes of a rollout server for RL (SGLang's names), on every engine replica at once:

- POST /update_weights_from_disk {"model_path", "in_flight"?, "weight_version"?}: a checkpoint of the same architecture;
  answers when every replica has switched. Another shape (or a missing tensor) is a 400 and the old
  weights stay.
- POST /init_weights_update_group {"master_address", "master_port", "rank_offset", "world_size",
  "backend"?}: each replica joins the trainer's torch.distributed group (livemoe.engine.core.weight_sync) as
  rank rank_offset + its index; the trainer (rank 0) joins meanwhile.
- POST /update_weights_from_distributed {"names", "dtypes", "shapes", "in_flight"?, "weight_version"?}: receives
  the tensors the trainer broadcasts, in that order.
- POST /sleep {"level"?: 1 | 2}: frees the KV cache (2: also moves the weights to the host); requests
  until POST /wake_up get a 503. GET /is_sleeping.
- GET /get_server_info: the replicas and their state (a trainer reads data_parallel_size).

in_flight: "finish" (the default) lets the requests in flight end on the old weights first, while new
ones wait; "abort" ends them with an error at once; "interrupt" preempts them, to resume on the new weights from
where they stopped (EngineCore.settle_in_flight). weight_version (an int, SGLang's name): the new weights' label,
which each token they draw records, returned per token to a request with `return_weight_versions` (partial
rollouts: which tokens came after an update); an update without one leaves the weights unlabelled (null). Every
body is strict (an unknown field is a 400). They sit behind the API key, as /v1 does. The routes that change the server (ADMIN_WRITE_PATHS: the weight
updates, the group, sleep and wake_up) are off unless the server runs with `--enable-admin-routes` or
`--api-key`: a 403 naming both (guard.py), as vLLM keeps its dev endpoints behind a flag.
"""
import logging
from typing import Literal

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import Field

from livemoe.engine.server.protocol import StrictModel, error_body

log = logging.getLogger("livemoe.engine.server")

ADMIN_PATHS = ("/update_weights_from_disk", "/init_weights_update_group", "/update_weights_from_distributed",
               "/sleep", "/wake_up", "/is_sleeping", "/get_server_info")
ADMIN_WRITE_PATHS = ("/update_weights_from_disk", "/init_weights_update_group", "/update_weights_from_distributed",
                     "/sleep", "/wake_up")
InFlight = Literal["finish", "abort", "interrupt"]


class UpdateFromDisk(StrictModel):
    model_path: str = Field(min_length=1)
    in_flight: InFlight = "finish"
    weight_version: int | None = None  # the new weights' label, stamped on the tokens they draw (SGLang's name)


class InitGroup(StrictModel):
    master_address: str = Field(min_length=1)
    master_port: int = Field(gt=0, lt=65536)
    rank_offset: int = Field(ge=1)
    world_size: int = Field(ge=2)
    backend: Literal["gloo", "nccl"] = "gloo"
    timeout_s: float = Field(default=300.0, gt=0)


class UpdateFromDistributed(StrictModel):
    names: list[str] = Field(min_length=1)
    dtypes: list[str] = Field(min_length=1)
    shapes: list[list[int]] = Field(min_length=1)
    in_flight: InFlight = "finish"
    weight_version: int | None = None


class Sleep(StrictModel):
    level: Literal[1, 2] = 1


def add_admin_routes(app: FastAPI, engine) -> None:
    async def run(what: str, call):
        try:
            result = await call
        except ValueError as e:  # CheckpointError, a bad group or tensor list: the message says what
            log.warning("%s refused: %s", what, e)
            return JSONResponse(error_body(f"{what}: {e}"), status_code=400)
        except RuntimeError as e:  # e.g. no group yet, asleep already
            log.warning("%s failed: %s", what, e)
            return JSONResponse(error_body(f"{what}: {e}", kind="conflict"), status_code=409)
        log.info("%s done", what)
        return {"success": True, "message": f"{what} done", **({"num_tensors": result} if result is not None else {})}

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(body: UpdateFromDisk):
        return await run(f"update_weights_from_disk {body.model_path}",
                         engine.update_weights_from_disk(body.model_path, in_flight=body.in_flight,
                                                         weight_version=body.weight_version))

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(body: InitGroup):
        last = body.rank_offset + engine.weight_update_ranks - 1
        if last >= body.world_size:
            return JSONResponse(error_body(f"this server has {engine.data_parallel_size} replica(s) of "
                                           f"{engine.tensor_parallel_size} tensor-parallel rank(s), ranks "
                                           f"{body.rank_offset}..{last}, beyond world_size {body.world_size}"),
                                status_code=400)
        return await run("init_weights_update_group", engine.init_weights_update_group(**body.model_dump()))

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(body: UpdateFromDistributed):
        return await run("update_weights_from_distributed", engine.update_weights_from_distributed(
            body.names, body.dtypes, body.shapes, in_flight=body.in_flight, weight_version=body.weight_version))

    @app.post("/sleep")
    async def sleep(body: Sleep | None = None):
        level = 1 if body is None else body.level
        return await run(f"sleep level {level}", engine.sleep(level))

    @app.post("/wake_up")
    async def wake_up():
        return await run("wake_up", engine.wake_up())

    @app.get("/is_sleeping")
    async def is_sleeping():
        return {"is_sleeping": bool(engine.sleep_level), "level": engine.sleep_level}

    @app.get("/get_server_info")
    async def get_server_info():
        errors = engine.replica_errors()
        stats = engine.stats()
        return {"data_parallel_size": engine.data_parallel_size, "max_model_len": engine.max_model_len,
                "weight_update_ranks": engine.weight_update_ranks,
                "tensor_parallel_size": stats.get("tensor_parallel_size"),
                "expert_parallel": stats.get("expert_parallel"),
                "sleep_level": engine.sleep_level, "served_per_replica": engine.served_per_replica(),
                "dead_replicas": {str(i): str(e) for i, e in enumerate(errors) if e is not None},
                "core_pids": engine.core_pids()}
