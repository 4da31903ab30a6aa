"""The docs keep step with the code: every hook is in the plugin guide with its signature,
every hook the guide names exists, the design map names every package folder, and the
docs' links to files of the repository lead somewhere."""

import inspect
import re
from pathlib import Path

import pytest

from kspipe.registry import hookspecs

ROOT = Path(__file__).resolve().parents[2]
PLUGINS_MD = ROOT / "docs" / "plugins.md"
DESIGN_MD = ROOT / "docs" / "design.md"

HOOKS = {
    name: fn
    for name, fn in inspect.getmembers(hookspecs, inspect.isfunction)
    if name.startswith("kspipe_")
}

#: The package folders the design map must name (the check below also finds new ones).
FOLDERS = ("modes", "reptile", "ctr", "datafeed", "fewshot", "observers", "openks", "testing")


def signature(name: str) -> str:
    """``name(a, b, c)``, as the guide writes a hook."""
    return f"{name}({', '.join(inspect.signature(HOOKS[name]).parameters)})"


def test_the_spec_has_hooks():
    assert len(HOOKS) >= 18
    assert "kspipe_describe_workload" in HOOKS and "kspipe_on_stage_error" in HOOKS


@pytest.mark.parametrize("name", sorted(HOOKS))
def test_every_hook_is_in_the_plugin_guide_with_its_signature(name):
    assert f"`{signature(name)}`" in PLUGINS_MD.read_text(), (
        f"docs/plugins.md should name the hook as `{signature(name)}`"
    )


def named_hooks(text: str) -> set[str]:
    """Hooks a document names: a code span that starts with ``kspipe_<name>`` followed by
    its closing backtick or its arguments, or ``def kspipe_<name>(`` in a code block."""
    return set(re.findall(r"`(kspipe_\w+)[`(]", text)) | set(
        re.findall(r"\bdef (kspipe_\w+)\(", text)
    )


#: The guide's example of a misspelt hook name, which kspipe refuses at start-up.
MISSPELT_EXAMPLE = "kspipe_read_datset"


def test_every_hook_the_plugin_guide_names_exists():
    text = PLUGINS_MD.read_text()
    assert f"misspelt hook name (`{MISSPELT_EXAMPLE}`)" in text
    named = named_hooks(text) - {MISSPELT_EXAMPLE}
    assert named, "no hook found in docs/plugins.md"
    assert not named - set(HOOKS), (
        f"docs/plugins.md names hooks that do not exist: {named - set(HOOKS)}"
    )


def test_the_plugin_guide_gives_each_hook_one_signature():
    """A hook written with other arguments than its spec's is out of date."""
    text = PLUGINS_MD.read_text()
    for name in HOOKS:
        for args in re.findall(rf"`{name}\(([^)`]*)\)`", text):
            assert f"{name}({args})" == signature(name), (
                f"docs/plugins.md writes `{name}({args})`; the spec is `{signature(name)}`"
            )


def package_folders() -> set[str]:
    return {
        p.parent.name for p in (ROOT / "kspipe").glob("*/*.py") if p.parent.name != "__pycache__"
    }


def test_the_design_map_names_every_package_folder():
    folders = package_folders()
    assert set(FOLDERS) <= folders
    text = DESIGN_MD.read_text()
    missing = sorted(f for f in folders if f"kspipe/{f}/" not in text)
    assert not missing, f"docs/design.md does not name kspipe/{missing}"


def test_the_guide_shows_the_collision_warning_kspipe_prints(capsys):
    from kspipe.registry.plugin_manager import warn_collision

    warn_collision("reptile", "my-package")
    line = capsys.readouterr().err.strip()
    assert line in PLUGINS_MD.read_text()


DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_links_to_repository_files_lead_somewhere(doc):
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # a web address or an anchor
        if not (doc.parent / target.split("#")[0]).exists():
            broken.append(target)
    assert not broken, f"{doc.name} links to files that are not there: {broken}"


#: ``kspipe.<module>.<name>(<parameters>)`` in a code span of the guide.
HELPER = re.compile(r"`(kspipe(?:\.\w+)+)\.(\w+)\(((?:[^()`]|\([^()`]*\))*)\)`")


def helpers_named(text: str) -> dict:
    """``{"kspipe.mod.name": [written parameter, ...]}`` of the guide's helper spans."""
    return {
        f"{module}.{name}": [a.strip() for a in args.split(",") if a.strip()]
        for module, name, args in HELPER.findall(text)
    }


def written(parameter) -> str:
    """A parameter as the guide writes it: ``name``, ``name=default``, ``*name``."""
    if parameter.kind is parameter.VAR_POSITIONAL:
        return f"*{parameter.name}"
    if parameter.default is parameter.empty:
        return parameter.name
    default = parameter.default
    return (
        f"{parameter.name}={default!r}".replace("'", '"')
        if isinstance(default, str)
        else f"{parameter.name}={default}"
    )


def test_every_helper_in_the_plugin_guide_has_its_signature():
    import importlib

    found = helpers_named(PLUGINS_MD.read_text())
    assert len(found) >= 10
    for path, args in found.items():
        module, _, name = path.rpartition(".")
        helper = getattr(importlib.import_module(module), name)
        if "..." in args:  # an example call, not the signature
            continue
        expected = [written(p) for p in inspect.signature(helper).parameters.values()]
        assert args == expected, f"docs/plugins.md writes `{path}({', '.join(args)})`"


def test_the_helpers_the_example_plugins_use_are_in_the_plugin_guide():
    """Every function of kspipe that the shipped plugins (and the tests' own) import, from
    wherever they import it, is a name of ``kspipe.api`` that the guide gives with its
    signature."""
    import importlib

    import kspipe.api

    documented = {
        getattr(kspipe.api, path.rpartition(".")[2])
        for path in helpers_named(PLUGINS_MD.read_text())
        if path.startswith("kspipe.api.")
    }
    sources = [
        *(ROOT / "plugins").glob("*/*/*.py"),
        *(ROOT / "plugins").glob("*/tests/*.py"),
        *(ROOT / "tests" / "plugins").glob("*/kspipe_*/*.py"),
    ]
    used = {}
    for source in sources:
        for module, names in re.findall(
            r"^\s*from (kspipe(?:\.\w+)*) import ([\w, ]+)$", source.read_text(), re.M
        ):
            for name in (n.strip() for n in names.split(",")):
                helper = getattr(importlib.import_module(module), name, None)
                if inspect.isfunction(helper):
                    used[f"{module}.{name}"] = helper
    assert used, "no helper found in the example plugins"
    missing = sorted(path for path, helper in used.items() if helper not in documented)
    assert not missing, f"not in docs/plugins.md as kspipe.api.<name>(...): {missing}"


def test_the_plugin_guide_gives_the_reporters_methods_with_their_signatures():
    """``reporter.<method>(<parameters>)`` as :class:`kspipe.contracts.Reporter` declares
    each, and its ``run_dir``."""
    from kspipe.contracts import Reporter

    text = PLUGINS_MD.read_text()
    methods = [name for name in vars(Reporter) if not name.startswith("_")]
    assert sorted(methods) == ["artifact", "metrics", "progress", "say"]
    for name in methods:
        parameters = list(inspect.signature(getattr(Reporter, name)).parameters.values())[1:]
        span = f"`reporter.{name}({', '.join(written(p) for p in parameters)})`"
        assert span in text, f"docs/plugins.md should name {span}"
    assert "`reporter.run_dir`" in text


#: A path of the repository as the documents name it, in a code span or in prose: from one
#: of its top folders (a link's target, ``../kspipe/...``, is the link test's).
REPO_PATH = re.compile(
    r"(?<![\w./-])((?:kspipe|tests|bench|conf|docs|plugins|examples|\.ci)/[\w./-]*\w/?)"
)

PAGES = [*DOCS, ROOT / "BENCHMARKS.md", ROOT / "CHANGELOG.md"]


@pytest.mark.parametrize("doc", PAGES, ids=lambda p: p.name)
def test_every_path_a_document_names_exists(doc):
    missing = sorted({p for p in REPO_PATH.findall(doc.read_text()) if not (ROOT / p).exists()})
    assert not missing, f"{doc.name} names paths that are not there: {missing}"


README = ROOT / "README.md"


def test_the_readme_is_a_first_page():
    """What kspipe is, its install, the main job, where results go and how to open them,
    and the test command, in the first screen; at most 200 lines in all."""
    lines = README.read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines"
    screen = "\n".join(lines[:42])
    for needed in (
        'pip install -e ".[test]"',
        "kspipe +experiment=omniglot_5way",
        "outputs/<date>/<time>/",
        "mlflow ui --backend-store-uri sqlite:///mlflow.db",
        "python -m pytest",
    ):
        assert needed in screen, f"README.md's first screen lacks {needed!r}"


def test_ci_installs_and_tests_as_the_readme_says():
    ci = (ROOT / ".ci" / "run").read_text()
    readme = README.read_text()
    assert 'python -m pip install -e ".[test]"' in ci and 'pip install -e ".[test]"' in readme
    assert re.search(r"^python -m pytest$", ci, re.M) and "python -m pytest" in readme
    packages = set(re.findall(r"apt_install ([\w -]+)", ci)[0].split())
    for line in re.findall(r"apt_install ([\w -]+)$", ci, re.M):
        packages |= set(line.split())
    assert packages >= {"chromium", "slurmctld", "slurmd", "slurm-client", "munge"}
    missing = sorted(p for p in packages if p not in readme)
    assert not missing, f".ci/run installs {missing}, which README.md does not name"


#: The main job's duration, with its machine, as every page that gives it says it
#: (BENCHMARKS.md has the measured figures).
DURATION = "about 4.5 minutes on a 2-core AMD EPYC"


def test_the_main_jobs_duration_is_said_one_way():
    pages = [README, ROOT / "docs" / "usage.md", ROOT / "conf/experiment/omniglot_5way.yaml"]
    for page in pages:
        text = " ".join(page.read_text().replace("#", " ").split())
        assert DURATION in text, f"{page.name} does not give the main job's duration"
        others = set(re.findall(r"[\d.]+(?: to [\d.]+)? minutes", text)) - {"4.5 minutes"}
        assert not others, f"{page.name} gives other durations: {others}"


#: The dated pages: measurements carry their date and machine there, and only there.
DATED = ("benchmark-log.md",)


@pytest.mark.parametrize("doc", [d for d in DOCS if d.name not in DATED], ids=lambda p: p.name)
def test_no_dated_measurement_outside_the_benchmark_pages(doc):
    dates = re.findall(r"\b20\d\d-\d\d-\d\d\b", doc.read_text())
    assert not dates, f"{doc.name} has dated measurements ({dates}): BENCHMARKS.md holds them"


def test_the_docs_say_seed_only_for_the_key():
    """ "The seed" once meant the code kspipe grew from, which clashed with the ``seed`` key."""
    saying = [d.name for d in DOCS if d.name not in DATED and "the seed" in d.read_text().lower()]
    assert not saying, f"'the seed' in {saying}"
