"""`autorepair sim`'s control endpoint: a small local HTTP API over the simulated fleet, and its clients.

Plain JSON over HTTP on loopback, so what the demo does to the fleet is what anyone can do with curl:

    GET  /healthz                                 {"instances": N, "probes": "real" | "stand-in"}
    GET  /world                                   AWS's counts and the fleet's lists (simulator.fleet_view.FleetWorld)
    GET  /instances/{id}/container-instances      {"arns": [...]}: what its ECS agent registered
    GET  /instances/{id}/commands/{command}       {"not_run": bool}: whether its SSM agent has yet to run it
    POST /scenario                                the scenario of the sim's flags, once: {"faulted": {id: line}, ...}
    POST /instances/{id}/fault     {"xid": 79}    a critical Xid in its kernel log (the Xid drawn when left out)
    POST /instances/{id}/noise     {"xid": 13}    an application Xid: counted, never a repair
    POST /instances/{id}/heartbeat-loss           its agent down for good
    POST /instances/{id}/blip      {"seconds": 3} its agent down briefly

An unknown instance is 404, a bad body 400, a second POST /scenario 409; the answer's "error" says why.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from datetime import timedelta
from typing import Any

from pydantic import BaseModel, Field

from simulator.fleet import SimulatedFleet
from simulator.fleet_view import FleetWorld

NOISE_INSTANCES = 2  # healthy instances that get an application Xid when a scenario is played: never repaired


class Scenario(BaseModel):
    """What POST /scenario plays, from `autorepair sim`'s flags: on distinct random live instances."""

    faults: int = Field(default=0, ge=0)
    heartbeat_loss: int = Field(default=0, ge=0)
    blips: int = Field(default=0, ge=0)
    noise: int = Field(default=NOISE_INSTANCES, ge=0)


class ScenarioPlayed(BaseModel):
    faulted: dict[str, str] = Field(default_factory=dict)  # instance -> the fault's first kernel line
    lost: list[str] = Field(default_factory=list)
    blipped: list[str] = Field(default_factory=list)
    blip_seconds: float = 0.0
    noise: dict[str, str] = Field(default_factory=dict)


async def play(fleet: SimulatedFleet, scenario: Scenario) -> ScenarioPlayed:
    """Noise on a few healthy instances, then faults, agent losses and blips, each on distinct random instances, all
    drawn from the fleet's own seeded rng: a seed replays the same scenario."""
    instances = fleet.live_instances()
    chosen = fleet.rng.sample(
        instances, min(len(instances), scenario.faults + scenario.heartbeat_loss + scenario.blips)
    )
    faulted = chosen[: scenario.faults]
    lost = chosen[scenario.faults : scenario.faults + scenario.heartbeat_loss]
    blipped = chosen[scenario.faults + scenario.heartbeat_loss :]
    rest = [i for i in instances if i not in chosen]
    played = ScenarioPlayed(blip_seconds=fleet.timing.blip.total_seconds())
    for instance_id in fleet.rng.sample(rest, min(scenario.noise, len(rest))):
        played.noise[instance_id] = fleet.inject_noise(instance_id)
    for instance_id in faulted:
        played.faulted[instance_id] = fleet.inject_fault(instance_id)
    for instance_id in lost:
        await fleet.heartbeat_loss(instance_id)
        played.lost.append(instance_id)
    for instance_id in blipped:
        await fleet.blip(instance_id)
        played.blipped.append(instance_id)
    return played


def control_app(fleet: SimulatedFleet, scenario: Scenario) -> Any:
    """The aiohttp application serving the routes above for `fleet`."""
    from aiohttp import web

    played: list[ScenarioPlayed] = []

    def answer(body: BaseModel | dict[str, Any], status: int = 200) -> web.Response:
        text = body.model_dump_json() if isinstance(body, BaseModel) else json.dumps(body)
        return web.Response(text=text, status=status, content_type="application/json")

    def instance(request: web.Request) -> str:
        instance_id = request.match_info["instance"]
        if instance_id not in fleet.nodes:
            raise web.HTTPNotFound(
                text=json.dumps({"error": f"{instance_id} is not an instance of {fleet.group}"}),
                content_type="application/json",
            )
        return instance_id

    async def body(request: web.Request) -> dict[str, Any]:
        if not request.can_read_body:
            return {}
        try:
            parsed = await request.json()
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict):
            raise web.HTTPBadRequest(text=json.dumps({"error": "the body must be a JSON object"}))
        return parsed

    async def healthz(_: web.Request) -> web.Response:
        return answer({"instances": len(fleet.live_instances()), "probes": fleet.probe_kind})

    async def world(_: web.Request) -> web.Response:
        return answer(await fleet.world())

    async def container_instances(request: web.Request) -> web.Response:
        return answer({"arns": sorted(fleet.container_instances_of(request.match_info["instance"]))})

    async def command(request: web.Request) -> web.Response:
        info = request.match_info
        return answer({"not_run": fleet.command_not_run(info["instance"], info["command"])})

    async def scenario_(_: web.Request) -> web.Response:
        if played:
            return answer({"error": "the scenario was played already", "played": played[0].model_dump()}, 409)
        played.append(await play(fleet, scenario))
        return answer(played[0])

    async def fault(request: web.Request) -> web.Response:
        instance_id, xid = instance(request), (await body(request)).get("xid")
        try:
            return answer({"line": fleet.inject_fault(instance_id, None if xid is None else int(xid))})
        except (ValueError, TypeError) as err:
            return answer({"error": str(err)}, 400)

    async def noise(request: web.Request) -> web.Response:
        instance_id, xid = instance(request), (await body(request)).get("xid")
        try:
            return answer({"line": fleet.inject_noise(instance_id, None if xid is None else int(xid))})
        except (ValueError, TypeError) as err:
            return answer({"error": str(err)}, 400)

    async def heartbeat_loss(request: web.Request) -> web.Response:
        instance_id = instance(request)
        await fleet.heartbeat_loss(instance_id)
        return answer({"instance": instance_id, "agent": "down"})

    async def blip(request: web.Request) -> web.Response:
        instance_id, seconds = instance(request), (await body(request)).get("seconds")
        duration = None if seconds is None else timedelta(seconds=float(seconds))
        await fleet.blip(instance_id, duration)
        return answer({"instance": instance_id, "agent": "down briefly"})

    app = web.Application()
    app.add_routes(
        [
            web.get("/healthz", healthz),
            web.get("/world", world),
            web.get("/instances/{instance}/container-instances", container_instances),
            web.get("/instances/{instance}/commands/{command}", command),
            web.post("/scenario", scenario_),
            web.post("/instances/{instance}/fault", fault),
            web.post("/instances/{instance}/noise", noise),
            web.post("/instances/{instance}/heartbeat-loss", heartbeat_loss),
            web.post("/instances/{instance}/blip", blip),
        ]
    )
    return app


class SimClient:
    """The demo's side of the control endpoint at `url` (http://host:port). Blocking (urllib): each call in a thread
    from async code, or straight from the AWS proxy's threads (container_instances_of)."""

    def __init__(self, url: str, timeout_s: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self._timeout_s = timeout_s

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None, timeout_s: float | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            f"{self.url}{path}", data=data, method=method, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=timeout_s or self._timeout_s) as response:
            return json.loads(response.read())

    def world(self) -> FleetWorld:
        return FleetWorld.model_validate(self._call("GET", "/world"))

    def play_scenario(self) -> ScenarioPlayed:
        return ScenarioPlayed.model_validate(self._call("POST", "/scenario", {}))

    def inject_fault(self, instance_id: str, xid: int | None = None) -> str:
        return str(self._call("POST", f"/instances/{instance_id}/fault", {} if xid is None else {"xid": xid})["line"])

    def command_not_run(self, instance_id: str, command_id: str) -> bool:
        """Whether the sim's host has yet to run the SSM command; False when the sim does not answer (moto's answer
        stands)."""
        try:
            found = self._call("GET", f"/instances/{instance_id}/commands/{command_id}", timeout_s=2.0)
        except (OSError, ValueError, urllib.error.URLError):
            return False
        return found.get("not_run") is True

    def container_instances_of(self, instance_id: str) -> set[str] | None:
        """What the sim's ECS agent registered for the instance; None when the sim does not answer (killed, being
        started again): the caller asks moto instead."""
        try:
            found = self._call("GET", f"/instances/{instance_id}/container-instances", timeout_s=2.0)
        except (OSError, ValueError, urllib.error.URLError):
            return None
        return {str(arn) for arn in found.get("arns", [])}
