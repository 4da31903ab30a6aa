"""The job's secret (kspipe/cluster/secret.py): where a job's processes get it, and when a
job is refused for want of one."""

import pytest

from kspipe.cluster import secret
from kspipe.cluster.plan import launch_plan
from kspipe.errors import ConfigError


@pytest.fixture(autouse=True)
def no_secret(monkeypatch):
    monkeypatch.delenv(secret.SECRET_ENV, raising=False)
    monkeypatch.setattr(secret, "_drawn", None)


def test_the_command_draws_one_every_process_of_its_plan_gets(monkeypatch):
    plan = launch_plan("pserver", 2, 1, threads=1)
    (drawn,) = {p.env[secret.SECRET_ENV] for p in plan}
    assert len(drawn) == 64 and int(drawn, 16) >= 0
    assert launch_plan("collective", 2)[0].env[secret.SECRET_ENV] == drawn  # the same job
    assert secret.ensure(new_job=True) != drawn  # a sweep's next job: another


def test_a_given_secret_is_kept_from_the_environment_or_a_file(monkeypatch, tmp_path):
    monkeypatch.setenv(secret.SECRET_ENV, "1f" * 32)
    assert secret.ensure(across_hosts=True, new_job=True) == "1f" * 32
    monkeypatch.delenv(secret.SECRET_ENV)
    path = tmp_path / "secret"
    path.write_text("2e" * 32 + "\n")
    assert secret.ensure(str(path), across_hosts=True) == "2e" * 32
    assert launch_plan("pserver", 1, 1)[0].env[secret.SECRET_ENV] == "2e" * 32


@pytest.mark.parametrize(
    "given, message",
    [
        ({}, "a job across hosts needs the same secret on every host: export KSPIPE_JOB_SECRET"),
        ({"file": "missing"}, "cluster.secret_file="),
        ({"env": "short"}, "KSPIPE_JOB_SECRET: the job's secret is 32 characters or more"),
        ({"env": "a b" * 20}, "without spaces"),
    ],
)
def test_a_job_across_hosts_without_a_usable_secret_is_one_line(
    monkeypatch, tmp_path, given, message
):
    if "env" in given:
        monkeypatch.setenv(secret.SECRET_ENV, given["env"])
    path = str(tmp_path / given["file"]) if "file" in given else None
    with pytest.raises(ConfigError, match=message) as refused:
        secret.ensure(path, across_hosts=True)
    assert "\n" not in str(refused.value)
    if "env" in given:
        assert given["env"] not in str(refused.value)  # a secret is never said


def test_tags_differ_by_purpose_name_and_secret(monkeypatch):
    monkeypatch.setenv(secret.SECRET_ENV, "1f" * 32)
    tags = {secret.tag(p, n) for p in ("chain", "hosts") for n in ("0", "1")}
    other = secret.tag("chain", "0", {secret.SECRET_ENV: "2e" * 32})
    assert len(tags) == 4 and other not in tags
    assert all(len(t) == secret.TAG_BYTES for t in tags)
    assert "1f" * 16 not in secret.token("gloo")
