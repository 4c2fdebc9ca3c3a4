"""Each user's files in a volume of their own (``hubplugin/volumes.py``).

The real hub of ``compose/jupyterhub_config.py`` on the real Docker engine: a user's server
mounts the user's named volume (type ``volume``, never a bind) at the work dir; a file
written there is in the next server of the same user, after the first is stopped and its
container gone; another user's server sees an empty volume of its own. With the site's
driver options the engine makes the volume with them. The pure parts: names, mounts, the
settings from the environment.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiodocker
import pytest
from aiodocker.volumes import DockerVolume
from dockerspawner import DockerSpawner
from traitlets import TraitError

from hubplugin.spawner import GPUSwarmSpawner
from hubplugin.volumes import (
    DRIVER_VARIABLE,
    OPTIONS_VARIABLE,
    VOLUME_VARIABLE,
    UserVolume,
    VolumeSettingError,
    user_volume_from_env,
    user_volume_mount,
    volume_name,
)
from tests.support.hub_e2e import (
    HubFactory,
    containers_gone,
    run_in,
    service_container,
    service_spec,
)

TEST_BUDGET_S = 150
WORK = "/home/jovyan/work"
NO_BROKER = "amqp://guest:guest@127.0.0.1:1/"  # servers without a GPU need no allocator


# ------------------------------------------------------------------------- the real hub


@pytest.mark.hub
@pytest.mark.docker
@pytest.mark.slow
async def test_a_users_files_outlive_their_server_and_no_one_else_sees_them(
    hub_factory: HubFactory, docker: aiodocker.Docker,
) -> None:
    async with asyncio.timeout(TEST_BUDGET_S):
        hub = await hub_factory(amqp_url=NO_BROKER)
        alice = hub.service_name("alice")
        await hub.start_server("alice", {"mode": "none"})
        spec = await service_spec(docker, alice)
        assert spec["TaskTemplate"]["ContainerSpec"]["Mounts"] == [
            {"Type": "volume", "Source": f"{hub.prefix}-home-alice", "Target": WORK}]
        first = await service_container(docker, alice)
        assert await run_in(first, "sh", "-c", f"echo 'alice was here' > {WORK}/notes.txt") \
            == (0, "")

        await hub.stop_server("alice")
        # The service is gone, but its container may still hold the server's port (host
        # networking) for a moment: the next server of the same user starts once it is gone.
        await containers_gone(docker, alice)
        await hub.start_server("alice", {"mode": "none"})
        second = await service_container(docker, alice)
        assert second.id != first.id
        assert await run_in(second, "cat", f"{WORK}/notes.txt") == (0, "alice was here\n")

        # bob's server: a volume of his own, empty; alice's file is nowhere in it
        await hub.start_server("bob", {"mode": "none"})
        bob = await service_container(docker, hub.service_name("bob"))
        assert await run_in(bob, "ls", "-A", WORK) == (0, "")
        bobs = (await service_spec(docker, hub.service_name("bob")))
        assert bobs["TaskTemplate"]["ContainerSpec"]["Mounts"][0]["Source"] == \
            f"{hub.prefix}-home-bob"
        volume = await DockerVolume(docker, f"{hub.prefix}-home-alice").show()
        assert volume["Driver"] == "local"
        await hub.stop_server("alice")
        await hub.stop_server("bob")


@pytest.mark.hub
@pytest.mark.docker
@pytest.mark.slow
async def test_the_engine_makes_the_volume_with_the_sites_driver_and_options(
    hub_factory: HubFactory, docker: aiodocker.Docker,
) -> None:
    # The local driver's tmpfs stands for a site's NFS: options the engine passes to mount.
    options = {"type": "tmpfs", "device": "tmpfs", "o": "size=4m"}
    async with asyncio.timeout(TEST_BUDGET_S):
        hub = await hub_factory(amqp_url=NO_BROKER, extra={
            "user_volume_driver": "local", "user_volume_driver_options": options})
        await hub.start_server("carol", {"mode": "none"})
        spec = await service_spec(docker, hub.service_name("carol"))
        (mount,) = spec["TaskTemplate"]["ContainerSpec"]["Mounts"]
        assert mount["Type"] == "volume"
        assert mount["VolumeOptions"]["DriverConfig"] == {"Name": "local", "Options": options}
        volume = await DockerVolume(docker, f"{hub.prefix}-home-carol").show()
        assert volume["Driver"] == "local" and volume["Options"] == options
        container = await service_container(docker, hub.service_name("carol"))
        code, mounts = await run_in(container, "cat", "/proc/mounts")
        assert code == 0
        assert any(line.split()[1:3] == [WORK, "tmpfs"] for line in mounts.splitlines()), mounts
        await hub.stop_server("carol")


# ----------------------------------------------------------------------- the settings


def test_each_user_gets_a_volume_docker_accepts_and_no_two_share_one() -> None:
    escape = DockerSpawner._escape  # what the spawner's escaped_name is made with
    names = {user: volume_name("swarm-gpu-home-{username}", escape(user))
             for user in ("alice", "Alice.B", "alice-b", "alice_b", "ünï", "a b", "x" * 40)}
    assert names["alice"] == "swarm-gpu-home-alice"
    assert names["alice-b"] == "swarm-gpu-home-alice-2db"
    assert len(set(names.values())) == len(names)


@pytest.mark.parametrize("template, needle", [
    ("swarm-gpu-home", "has no {username}"),
    ("home/{username}", "which Docker refuses"),
    ("-{username}", "which Docker refuses"),
    ("{username} home", "which Docker refuses"),
])
def test_a_template_that_makes_no_valid_name_is_refused(template: str, needle: str) -> None:
    with pytest.raises(VolumeSettingError, match=needle):
        volume_name(template, "alice")
    with pytest.raises(TraitError, match=needle):
        GPUSwarmSpawner(user_volume=template)


def test_the_mount_is_a_volume_with_a_driver_only_when_one_is_given() -> None:
    assert user_volume_mount(UserVolume("home-{username}"), "alice") == {
        "Type": "volume", "Source": "home-alice", "Target": WORK}
    nfs = UserVolume("home-{username}", driver="local", target="/home/me", options={
        "type": "nfs", "o": "addr=10.0.0.5,rw", "device": ":/export/{username}"})
    assert user_volume_mount(nfs, "bob") == {
        "Type": "volume", "Source": "home-bob", "Target": "/home/me",
        "VolumeOptions": {"DriverConfig": {"Name": "local", "Options": {
            "type": "nfs", "o": "addr=10.0.0.5,rw", "device": ":/export/bob"}}}}
    plugin = user_volume_mount(UserVolume("h-{username}", driver="rexray"), "c")
    assert plugin["VolumeOptions"] == {"DriverConfig": {"Name": "rexray", "Options": {}}}
    with pytest.raises(VolumeSettingError, match="not an absolute path"):
        user_volume_mount(UserVolume("h-{username}", target="work"), "c")


def test_the_spawner_adds_the_users_volume_to_swarmspawners_mounts() -> None:
    from types import SimpleNamespace

    user = SimpleNamespace(name="Dora", groups=[], url="/user/Dora/")
    spawner = GPUSwarmSpawner(user=user, user_volume="site-{username}",
                              user_volume_driver="nfsplugin",
                              volumes={"/srv/data": {"bind": "/data", "mode": "ro"}})
    data, home = spawner.mounts
    assert data["Type"] == "bind" and data["Target"] == "/data"  # SwarmSpawner's own
    assert home == {"Type": "volume", "Source": "site--44ora", "Target": WORK,
                    "VolumeOptions": {"DriverConfig": {"Name": "nfsplugin", "Options": {}}}}
    assert GPUSwarmSpawner(user=user).mounts == []  # no volume unless configured


@pytest.mark.parametrize("env, expected", [
    ({}, UserVolume("swarm-gpu-home-{username}")),
    ({VOLUME_VARIABLE: ""}, None),
    ({VOLUME_VARIABLE: "lab-{username}", DRIVER_VARIABLE: "local",
      OPTIONS_VARIABLE: '{"type": "nfs", "device": ":/home/{username}"}'},
     UserVolume("lab-{username}", "local", {"type": "nfs", "device": ":/home/{username}"})),
])
def test_the_settings_from_the_environment(env: dict[str, str], expected: Any) -> None:
    assert user_volume_from_env(env) == expected


@pytest.mark.parametrize("env, needle", [
    ({VOLUME_VARIABLE: "shared"}, f"{VOLUME_VARIABLE}: .* has no {{username}}"),
    ({OPTIONS_VARIABLE: "type=nfs"}, f"{OPTIONS_VARIABLE}: not JSON"),
    ({OPTIONS_VARIABLE: '{"size": 4}'}, f"{OPTIONS_VARIABLE}: not a JSON object of strings"),
    ({OPTIONS_VARIABLE: '["a"]'}, f"{OPTIONS_VARIABLE}: not a JSON object of strings"),
])
def test_a_wrong_setting_names_its_variable(env: dict[str, str], needle: str) -> None:
    with pytest.raises(VolumeSettingError, match=needle):
        user_volume_from_env(env)
