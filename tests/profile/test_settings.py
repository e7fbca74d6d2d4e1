"""A framework's profiling hook takes `ProfileSettings`, the one list of its keywords: each is the `ProfileOptions`
field of `oneiter profile` it becomes (model_name: the model), with the same default (out_dir aside: a framework's
own folder), checked in mmengine's words."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from oneiter.profile.runner import ProfileOptions
from oneiter.profile.schedule import ProfileSchedule, parse_schedule
from oneiter.profile.stepped import ProfileSettings

SETTINGS = {f.name: f for f in dataclasses.fields(ProfileSettings)}
OPTIONS = {f.name: f for f in dataclasses.fields(ProfileOptions)}


def test_each_setting_is_a_profile_option_with_its_default():
    assert set(SETTINGS) - {"model_name"} <= set(OPTIONS)
    for name, field in SETTINGS.items():
        if name in ("model_name", "out_dir"):  # the model's class name; the framework's output folder
            continue
        assert field.default == OPTIONS[name].default, name


def test_settings_are_checked_and_normalised():
    settings = ProfileSettings(schedule={"active": 2}, out_dir="p", with_flops=True)
    assert settings.schedule == ProfileSchedule(wait=0, warmup=1, active=2) and settings.out_dir == Path("p")
    assert ProfileSettings().schedule == parse_schedule("wait=1,warmup=1,active=2") and ProfileSettings().module_ranges
    assert settings.profile_schedule is settings.schedule and settings.profile_dir == Path("p")
    assert ProfileSettings().profile_dir is None
    with pytest.raises(TypeError, match="with_stack should be a bool, but got 1"):
        ProfileSettings(with_stack=1)
    with pytest.raises(ValueError, match="memory_sort should be one of"):
        ProfileSettings(memory_sort="size")
    with pytest.raises(TypeError, match=r"Hook\(\) got an unexpected keyword argument 'trace_dir', but its keywords "
                                        r"are schedule, out_dir, record_shapes"):
        ProfileSettings.given("Hook", {"trace_dir": "x"})
