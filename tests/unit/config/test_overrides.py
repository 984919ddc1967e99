"""The knobs a user sets live in the manifest; an environment variable overrides each of them
(``pbt.config.read.overrides``), validated once by the controller, which hands members the values
in the canonical manifest."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support import FAKE, write_manifest
from support import FAKE_CAMPAIGN as MANIFEST

from pbt.cli.main import main
from pbt.config import Manifest, manifest_from_dict
from pbt.config.errors import ConfigError
from pbt.config.read.canonical import canonical_sections, manifest_from_canonical
from pbt.config.read.overrides import OVERRIDES, with_environment
from pbt.controller.campaign import Campaign
from pbt.controller.store import CampaignStore


def test_each_knob_is_a_manifest_field_with_its_default():
    m = Manifest()
    assert (m.launch.state_cache_gib, m.launch.device_state_cache_gib) == (8.0, 0.0)
    assert m.tracking.progress_every_s == 10.0
    for section, key in OVERRIDES.values():
        assert hasattr(getattr(m, section), key)
    written = manifest_from_dict(
        {"launch": {"state_cache_gib": 2, "device_state_cache_gib": 0.5}, "tracking": {
            "progress_every_s": 0}}
    )  # fmt: skip
    assert written.launch.state_cache_gib == 2 and written.tracking.progress_every_s == 0


@pytest.mark.parametrize(
    ("sections", "problem"),
    [
        ({"launch": {"state_cache_gib": -1}}, "launch.state_cache_gib (-1.0) must be >= 0; 0 keeps none"),
        ({"tracking": {"progress_every_s": -0.5}}, "tracking.progress_every_s (-0.5) must be >= 0; 0 prints none"),
        (
            {"launch": {"state_cache_gib": 1, "device_state_cache_gib": 2}},
            "launch.device_state_cache_gib (2) must be <= state_cache_gib (1): a state stays on "
            "the GPU only while it is held in host memory; lower it or raise state_cache_gib",
        ),
    ],
)  # fmt: skip
def test_a_knob_in_the_manifest_is_checked_like_any_key(sections, problem):
    with pytest.raises(ConfigError) as err:
        manifest_from_dict(sections)
    assert err.value.problems == [problem]


def test_a_variable_overrides_its_field_and_leaves_the_manifest_alone():
    written = manifest_from_dict({"tracking": {"progress_every_s": 30}})
    env = {
        "PBT_STATE_CACHE_GIB": " 2.5 ",
        "PBT_PROGRESS_EVERY": "0",
        "PBT_DEVICE_STATE_CACHE_GIB": "",
    }
    out = with_environment(written, env)
    assert (out.launch.state_cache_gib, out.launch.device_state_cache_gib) == (2.5, 0.0)
    assert out.tracking.progress_every_s == 0.0
    assert written.tracking.progress_every_s == 30 and written.launch.state_cache_gib == 8.0
    assert with_environment(written, {}) is written  # nothing set: the manifest as it is
    # what a member is handed carries the value; it reads no variable of its own
    sections = json.loads(json.dumps(canonical_sections(out)))
    member = manifest_from_canonical(sections, base_dir=".")
    assert member.launch.state_cache_gib == 2.5 and member.tracking.progress_every_s == 0.0


@pytest.mark.parametrize(
    ("env", "problem"),
    [
        (
            {"PBT_STATE_CACHE_GIB": "lots"},
            "PBT_STATE_CACHE_GIB ('lots') overrides launch.state_cache_gib and must be a "
            "number, e.g. 8; set a number or unset it to keep the manifest's value",
        ),
        (
            {"PBT_PROGRESS_EVERY": "-1"},
            "tracking.progress_every_s (-1.0) must be >= 0; 0 prints none (set by "
            "PBT_PROGRESS_EVERY=-1)",
        ),
        (
            {"PBT_PROGRESS_EVERY": "nan"},
            "tracking.progress_every_s (nan) must be a finite number >= 0; 0 prints none (set "
            "by PBT_PROGRESS_EVERY=nan)",
        ),
        (
            {"PBT_DEVICE_STATE_CACHE_GIB": "16"},
            "launch.device_state_cache_gib (16) must be <= state_cache_gib (8): a state stays "
            "on the GPU only while it is held in host memory; lower it or raise "
            "state_cache_gib (set by PBT_DEVICE_STATE_CACHE_GIB=16)",
        ),
    ],
)
def test_a_bad_variable_is_one_line_naming_it_and_its_field(env, problem):
    with pytest.raises(ConfigError) as err:
        with_environment(Manifest(), env)
    assert err.value.problems == [problem] and err.value.source == "environment"


def test_pbt_check_applies_the_variables(tmp_path: Path, monkeypatch, capsys):
    manifest = write_manifest(tmp_path / "m.yaml", MANIFEST)
    monkeypatch.setenv("PBT_STATE_CACHE_GIB", "-3")
    assert main(["check", str(manifest)]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "error: environment: 1 problem",
        "  - launch.state_cache_gib (-3.0) must be >= 0; 0 keeps none (set by "
        "PBT_STATE_CACHE_GIB=-3)",
    ]
    monkeypatch.setenv("PBT_STATE_CACHE_GIB", "3")
    assert main(["check", "--resolved", str(manifest)]) == 0
    assert "  state_cache_gib: 3.0\n" in capsys.readouterr().out


def test_a_campaign_hands_members_the_override_and_stores_the_manifest_as_written(
    tmp_path: Path, monkeypatch
):
    """The override reaches the task a member reads; the store keeps the sections as written,
    so a resume without the variable goes back to the manifest's value."""
    manifest = write_manifest(tmp_path / "m.yaml", MANIFEST)
    directory = tmp_path / "c"
    monkeypatch.setenv("PBT_STATE_CACHE_GIB", "1.5")
    monkeypatch.setenv("PBT_PROGRESS_EVERY", "2")
    campaign = Campaign.start(manifest, directory, member_command=FAKE)
    try:
        assert campaign.manifest.launch.state_cache_gib == 1.5
        assert campaign._progress(0, 1).every_s == 2.0
        with CampaignStore(directory / "store.db") as store:
            member = store.members(0)[0]
            assert "state_cache_gib" not in json.dumps(store.load_config()["manifest"])
        task = json.loads((campaign._task(member).task_dir / "task.json").read_text())
        assert task["manifest"]["launch"]["state_cache_gib"] == 1.5
    finally:
        campaign.close()
    monkeypatch.delenv("PBT_STATE_CACHE_GIB")
    monkeypatch.setenv("PBT_PROGRESS_EVERY", "soon")
    with pytest.raises(ConfigError, match=r"PBT_PROGRESS_EVERY \('soon'\) overrides"):
        Campaign.resume(directory, member_command=FAKE)
    monkeypatch.delenv("PBT_PROGRESS_EVERY")
    again = Campaign.resume(directory, member_command=FAKE)
    try:
        assert again.manifest.launch.state_cache_gib == 8.0
    finally:
        again.close()
