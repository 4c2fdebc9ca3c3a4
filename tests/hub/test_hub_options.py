"""User GPU choices: parsing (form and REST), permission checks, and the allocate request."""

from __future__ import annotations

import pytest

from allocator.placement.cluster import GPU, Cluster
from allocator.placement.demand import resolve_models
from allocator.wire.protocol import AllocateRequest
from hubplugin.options import (
    GPUMode,
    GPUOptions,
    GPUPermissions,
    OptionsError,
    Profile,
    allowed_models_for,
    build_allocate_request,
    check_options,
    load_profiles,
    options_from_form,
    parse_user_options,
    request_key,
    resolve_profile,
)
from tests.support.hub_inventory import A100, GTX1070, RTX3090, inventory

INV = inventory()
STUDENTS = GPUPermissions(allowed_models=["1070"], max_gpus=2, groups=["students"])
STAFF = GPUPermissions(allowed_models=None, max_gpus=8, groups=["staff"])


# ----------------------------------------------------------------------- parsing REST JSON


def test_empty_options_mean_no_gpu() -> None:
    assert parse_user_options({}) == GPUOptions()
    assert parse_user_options(None).mode is GPUMode.NONE


def test_rest_json_parses_to_the_same_model() -> None:
    opts = parse_user_options({"mode": "exclusive", "model": "1070", "count": 2, "host": "gpu-a"})
    assert opts == GPUOptions(mode=GPUMode.EXCLUSIVE, model="1070", count=2, host="gpu-a")
    shared = parse_user_options({"mode": "shared", "share_memory_mib": 2048})
    assert shared.mode is GPUMode.SHARED and shared.share_memory_mib == 2048
    assert parse_user_options({"image": "x", "mode": "none"}).mode is GPUMode.NONE


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        ({"count": 0, "mode": "exclusive"}, "between 1 and 64"),
        ({"count": 10**6, "mode": "exclusive"}, "between 1 and 64"),
        ({"count": -3}, "between 1 and 64"),
        ({"count": True}, "whole number"),
        ({"count": 1.5}, "GPU count"),
        ({"count": "lots"}, "GPU count"),
        ({"mode": "root"}, "none, exclusive, shared"),
        ({"model": "10\n70"}, "GPU model"),
        ({"model": ""}, "GPU model"),
        ({"host": "a" * 500}, "host"),
        ({"share_memory_mib": 0}, "between 1 and"),
        ({"share_memory_mib": 10**12}, "between 1 and"),
        ({"gpus": 4}, "unknown option 'gpus'"),
        ({"profile": "../../etc"}, "profile"),
    ],
)
def test_forged_json_is_refused_with_a_clear_message(raw: dict, needle: str) -> None:
    with pytest.raises(OptionsError) as err:
        parse_user_options(raw)
    assert needle in str(err.value)
    assert str(err.value).startswith("Invalid GPU options")


def test_user_options_must_be_an_object() -> None:
    with pytest.raises(OptionsError, match="JSON object"):
        parse_user_options(["mode", "exclusive"])  # type: ignore[arg-type]


# --------------------------------------------------------------------------- form parsing


def test_form_fields_become_user_options() -> None:
    form = {
        "_xsrf": ["token"], "profile": ["custom"], "mode": ["exclusive"], "model": ["1070"],
        "count": ["2"], "host": [""], "share_memory_mib": ["4096"],
    }
    assert options_from_form(form) == {"mode": "exclusive", "model": "1070", "count": 2}


def test_form_all_gpus_of_host_and_shared() -> None:
    assert options_from_form({"mode": ["exclusive"], "count": ["all"], "host": ["gpu-b"]}) == {
        "mode": "exclusive", "all_gpus_of_host": True, "host": "gpu-b",
    }
    assert options_from_form(
        {"mode": ["shared"], "model": ["any"], "count": ["3"], "share_memory_mib": ["1024"]}
    ) == {"mode": "shared", "share_memory_mib": 1024}


def test_form_no_gpu_drops_other_fields() -> None:
    assert options_from_form({"mode": ["none"], "model": ["a100"], "count": ["8"]}) == {
        "mode": "none"
    }
    # a form without GPU fields chooses nothing: the spawn gets the admin's default
    assert options_from_form({}) == {}
    assert options_from_form({"image": ["lab"], "_xsrf": ["t"]}) == {"image": "lab"}


def test_form_profile_wins_over_custom_fields() -> None:
    form = {"profile": ["small-share"], "mode": ["exclusive"], "count": ["64"], "image": ["lab"]}
    assert options_from_form(form) == {"image": "lab", "profile": "small-share"}


@pytest.mark.parametrize(
    ("form", "needle"),
    [
        ({"mode": ["exclusive"], "count": ["two"]}, "whole number"),
        ({"mode": ["exclusive"], "count": ["0"]}, "between 1 and 64"),
        ({"mode": ["exclusive"], "count": ["1000000"]}, "between 1 and 64"),
        ({"mode": ["shared"], "share_memory_mib": ["1e9"]}, "whole number"),
        ({"mode": ["everything"]}, "GPU mode"),
        ({"profile": ["<script>"]}, "profile"),
    ],
)
def test_forged_form_is_refused(form: dict, needle: str) -> None:
    with pytest.raises(OptionsError, match=needle):
        options_from_form(form)


def test_form_output_round_trips_through_rest_parser() -> None:
    out = options_from_form({"mode": ["exclusive"], "model": [GTX1070], "count": ["all"]})
    assert parse_user_options(out) == GPUOptions(
        mode=GPUMode.EXCLUSIVE, model=GTX1070, all_gpus_of_host=True
    )


# -------------------------------------------------------------------------------- permissions


def test_allowed_models_union_over_groups() -> None:
    group_models = {"students": ["1070"], "ml": ["3090", "1070"], "staff": ["*"]}
    assert allowed_models_for(["students"], group_models, ["*"]) == ["1070"]
    assert allowed_models_for(["students", "ml"], group_models, ["*"]) == ["1070", "3090"]
    assert allowed_models_for(["ml", "staff"], group_models, ["*"]) is None
    assert allowed_models_for(["visitors"], group_models, ["*"]) is None
    assert allowed_models_for(["visitors"], group_models, []) == []
    assert allowed_models_for([], {}, ["1070"]) == ["1070"]


def test_model_the_group_may_not_use_is_refused() -> None:
    opts = GPUOptions(mode=GPUMode.EXCLUSIVE, model="a100")
    with pytest.raises(OptionsError) as err:
        check_options(opts, STUDENTS, INV)
    assert "may not use GPU model 'a100'" in str(err.value)
    assert "students" in str(err.value) and "1070" in str(err.value)
    # also without an inventory (allocator slow): plain name comparison
    with pytest.raises(OptionsError, match="may not use GPU model"):
        check_options(opts, STUDENTS, None)


def test_aliases_match_canonical_names() -> None:
    opts = GPUOptions(mode=GPUMode.EXCLUSIVE, model="NVIDIA GeForce GTX 1070")
    checked = check_options(opts, STUDENTS, INV)
    assert checked is not None and checked.model == GTX1070
    checked = check_options(GPUOptions(mode=GPUMode.EXCLUSIVE, model="GTX1070"), STUDENTS, INV)
    assert checked is not None and checked.model == GTX1070


def test_the_hub_accepts_every_spelling_the_allocator_accepts() -> None:
    # "gtx 1070" is neither a name nor an alias: the allocator derives it (vendor words and
    # punctuation do not matter), and so must the hub, with the inventory and without.
    for spelling in ("gtx 1070", "GTX-1070", "geforce gtx 1070", "nvidia gtx1070"):
        opts = GPUOptions(mode=GPUMode.EXCLUSIVE, model=spelling)
        checked = check_options(opts, STUDENTS, INV)
        assert checked is not None and checked.model == GTX1070, spelling
        without = GPUPermissions(allowed_models=["NVIDIA GeForce GTX 1070"], max_gpus=1)
        assert check_options(opts, without, None) is not None, spelling


def test_unknown_model_is_refused_with_the_allocators_text() -> None:
    cluster = Cluster(gpus={m: GPU(uuid=m, host="h", index=0, model=m, memory_total_mib=1)
                            for m in (GTX1070, RTX3090, A100)})
    aliases = {alias: model for model in (GTX1070, RTX3090, A100)
               for alias in {GTX1070: ["1070", "gtx1070"], RTX3090: ["3090"],
                             A100: ["a100"]}[model]}
    refusal = resolve_models(["h100"], cluster, aliases)
    with pytest.raises(OptionsError) as err:
        check_options(GPUOptions(mode=GPUMode.EXCLUSIVE, model="h100"), STAFF, INV)
    assert not isinstance(refusal, tuple) and refusal is not None
    assert str(err.value) == refusal.message


def test_unknown_model_lists_known_ones() -> None:
    with pytest.raises(OptionsError) as err:
        check_options(GPUOptions(mode=GPUMode.EXCLUSIVE, model="h100"), STAFF, INV)
    assert "Unknown GPU model 'h100'" in str(err.value)
    assert GTX1070 in str(err.value) and A100 in str(err.value)


def test_any_model_sends_the_allowed_list() -> None:
    checked = check_options(GPUOptions(mode=GPUMode.EXCLUSIVE), STUDENTS, INV)
    assert checked is not None and checked.model is None and checked.models == [GTX1070]
    checked = check_options(GPUOptions(mode=GPUMode.EXCLUSIVE), STAFF, INV)
    assert checked is not None and checked.models is None


def test_any_model_with_none_of_the_allowed_models_in_the_cluster() -> None:
    permissions = GPUPermissions(allowed_models=["h100"], max_gpus=1)
    with pytest.raises(OptionsError, match="None of the GPU models you may use"):
        check_options(GPUOptions(mode=GPUMode.EXCLUSIVE), permissions, INV)


def test_count_above_the_user_limit() -> None:
    with pytest.raises(OptionsError) as err:
        check_options(GPUOptions(mode=GPUMode.EXCLUSIVE, model="1070", count=3), STUDENTS, INV)
    assert "at most 2 GPUs per server; you asked for 3" in str(err.value)


def test_count_no_host_can_hold() -> None:
    with pytest.raises(OptionsError, match=r"No host has 6 GPUs of NVIDIA GeForce RTX 3090"):
        check_options(GPUOptions(mode=GPUMode.EXCLUSIVE, model="3090", count=6), STAFF, INV)
    with pytest.raises(OptionsError, match=r"Host 'gpu-a' has only 2 GPUs"):
        check_options(
            GPUOptions(mode=GPUMode.EXCLUSIVE, model="1070", count=3, host="gpu-a"), STAFF, INV
        )


def test_user_without_gpus() -> None:
    for permissions in (GPUPermissions(allowed_models=[], max_gpus=4), GPUPermissions(max_gpus=0)):
        with pytest.raises(OptionsError, match="You may not use GPUs"):
            check_options(GPUOptions(mode=GPUMode.EXCLUSIVE), permissions, INV)
        assert check_options(GPUOptions(mode=GPUMode.NONE), permissions, INV) is None


def test_unknown_host() -> None:
    with pytest.raises(OptionsError) as err:
        check_options(GPUOptions(mode=GPUMode.EXCLUSIVE, host="gpu-zz"), STAFF, INV)
    assert "Unknown host 'gpu-zz'" in str(err.value) and "gpu-a, gpu-b, gpu-c" in str(err.value)


def test_host_not_allowed() -> None:
    permissions = GPUPermissions(max_gpus=1, allowed_hosts=["gpu-a"])
    with pytest.raises(OptionsError, match="You may not use host 'gpu-c'"):
        check_options(GPUOptions(mode=GPUMode.EXCLUSIVE, host="gpu-c"), permissions, None)
    checked = check_options(GPUOptions(mode=GPUMode.EXCLUSIVE, host="gpu-a"), permissions, INV)
    assert checked is not None and checked.host == "gpu-a"


def test_host_without_the_model() -> None:
    with pytest.raises(OptionsError, match="Host 'gpu-a' has no GPU of NVIDIA A100"):
        check_options(
            GPUOptions(mode=GPUMode.EXCLUSIVE, model="a100", host="gpu-a"), STAFF, INV
        )


def test_share_larger_than_the_gpu() -> None:
    opts = GPUOptions(mode=GPUMode.SHARED, model="1070", share_memory_mib=9000)
    with pytest.raises(OptionsError) as err:
        check_options(opts, STUDENTS, INV)
    assert "larger than the GPU" in str(err.value) and "8192 MiB" in str(err.value)


def test_share_above_the_admin_maximum() -> None:
    permissions = GPUPermissions(max_gpus=1, max_share_memory_mib=2048)
    with pytest.raises(OptionsError, match="at most 2048 MiB; you asked for 4096"):
        check_options(GPUOptions(mode=GPUMode.SHARED, share_memory_mib=4096), permissions, None)


def test_share_of_an_exclusive_only_model() -> None:
    with pytest.raises(OptionsError, match="cannot be shared"):
        check_options(GPUOptions(mode=GPUMode.SHARED, model="3090"), STAFF, INV)


def test_shared_any_model_keeps_only_shareable_models() -> None:
    checked = check_options(GPUOptions(mode=GPUMode.SHARED, share_memory_mib=1024), STAFF, INV)
    assert checked is not None and checked.shared and checked.models == [GTX1070]
    assert checked.count == 1 and checked.share_memory_mib == 1024


def test_shared_default_budget_comes_from_the_permissions() -> None:
    permissions = GPUPermissions(max_gpus=1, default_share_memory_mib=1536)
    checked = check_options(GPUOptions(mode=GPUMode.SHARED), permissions, INV)
    assert checked is not None and checked.share_memory_mib == 1536


def test_all_gpus_of_host() -> None:
    opts = GPUOptions(mode=GPUMode.EXCLUSIVE, model="3090", all_gpus_of_host=True)
    checked = check_options(opts, STAFF, INV)
    assert checked is not None and checked.count == "all"
    with pytest.raises(OptionsError) as err:
        check_options(opts, GPUPermissions(max_gpus=2), INV)
    assert "could give you 4 GPUs, more than your limit of 2" in str(err.value)
    # any model: the 1070 host fits within 2, and the message says so
    with pytest.raises(OptionsError, match="Hosts within your limit: gpu-a"):
        check_options(GPUOptions(mode=GPUMode.EXCLUSIVE, all_gpus_of_host=True),
                      GPUPermissions(max_gpus=2), INV)
    with pytest.raises(OptionsError, match="not offered"):
        check_options(opts, GPUPermissions(max_gpus=8, allow_all_gpus_of_host=False), INV)


def test_trusted_profile_skips_user_limits_but_not_sanity() -> None:
    opts = GPUOptions(mode=GPUMode.EXCLUSIVE, model="a100", count=8)
    assert check_options(opts, STUDENTS, INV, trusted=True) is not None
    with pytest.raises(OptionsError, match="Unknown GPU model"):
        check_options(opts.model_copy(update={"model": "h100"}), STUDENTS, INV, trusted=True)


# ------------------------------------------------------------------------------ profiles


PROFILES = load_profiles([
    {"slug": "cpu", "display_name": "CPU only", "default": True},
    {"slug": "small-share", "display_name": "Small share", "mode": "shared", "model": "1070",
     "share_memory_mib": 2048},
    {"slug": "node", "display_name": "Whole node", "groups": ["staff"], "mode": "exclusive",
     "all_gpus_of_host": True},
])


def test_profile_resolves_to_its_choice() -> None:
    opts, profile = resolve_profile(GPUOptions(profile="small-share"), PROFILES, ["students"])
    assert profile is not None and profile.slug == "small-share"
    assert opts.mode is GPUMode.SHARED and opts.share_memory_mib == 2048


def test_profile_of_another_group_is_unknown() -> None:
    with pytest.raises(OptionsError) as err:
        resolve_profile(GPUOptions(profile="node"), PROFILES, ["students"])
    assert "Unknown profile 'node'" in str(err.value) and "cpu, small-share" in str(err.value)
    assert resolve_profile(GPUOptions(profile="node"), PROFILES, ["staff"])[1] is not None


def test_profile_plus_fields_is_refused() -> None:
    with pytest.raises(OptionsError, match="fixes the GPU choice; leave out count, mode"):
        resolve_profile(
            parse_user_options({"profile": "cpu", "mode": "exclusive", "count": 4}),
            PROFILES, [],
        )


def test_bad_profiles_are_config_errors() -> None:
    with pytest.raises(ValueError, match="duplicate slugs: a"):
        load_profiles([{"slug": "a", "display_name": "A"}, {"slug": "a", "display_name": "B"}])
    with pytest.raises(ValueError, match=r"gpu_profiles\[0\]"):
        load_profiles([{"slug": "custom", "display_name": "reserved"}])
    with pytest.raises(ValueError, match=r"gpu_profiles\[0\]"):
        load_profiles([{"slug": "x", "display_name": "X", "count": 0}])


def test_profile_summary() -> None:
    assert Profile(slug="a", display_name="A").summary() == "No GPU"
    assert PROFILES[1].summary() == "Shared slice of one GPU (1070, 2048 MiB)"
    assert PROFILES[2].summary() == "All GPUs of one host (any model)"


# ---------------------------------------------------------------------- allocate request


def test_allocate_request_is_built_and_valid() -> None:
    checked = check_options(
        GPUOptions(mode=GPUMode.EXCLUSIVE, model="1070", count=2, host="gpu-a"), STAFF, INV
    )
    assert checked is not None
    request = build_allocate_request(
        checked, hub_id="hub1", user="alice", server_name="gpu", groups=["staff"], wait_s=30,
        priority=5,
    )
    assert isinstance(request, AllocateRequest)
    assert request.request_key == "hub1/alice/gpu" == request_key("hub1", "alice", "gpu")
    assert (request.model, request.count, request.host) == (GTX1070, 2, "gpu-a")
    assert request.share is None and request.wait_s == 30 and request.priority == 5
    AllocateRequest.model_validate_json(request.model_dump_json())


def test_allocate_request_shared_and_all() -> None:
    shared = check_options(GPUOptions(mode=GPUMode.SHARED, model="1070", share_memory_mib=1000),
                           STUDENTS, INV)
    assert shared is not None
    request = build_allocate_request(shared, hub_id="h", user="bob", wait_s=10**9)
    assert request.request_key == "h/bob/"
    assert request.share is not None and request.share.memory_mib == 1000
    assert request.count == 1 and request.wait_s == 24 * 3600
    every = check_options(GPUOptions(mode=GPUMode.EXCLUSIVE, model="3090",
                                     all_gpus_of_host=True), STAFF, INV)
    assert every is not None
    assert build_allocate_request(every, hub_id="h", user="bob").count == "all"
    anything = check_options(GPUOptions(mode=GPUMode.EXCLUSIVE), STUDENTS, INV)
    assert anything is not None
    request = build_allocate_request(anything, hub_id="h", user="bob")
    assert request.model is None and request.models == [GTX1070]
    assert RTX3090 not in (request.models or [])
