"""eagle3.launch: the launcher's environment as one value."""
import pytest

from eagle3.launch import Launch, launch


def test_no_launcher_is_one_process():
    assert launch({}) == Launch(world_size=1, rank=0, local_rank=None, local_world_size=None)
    assert launch({}).is_main and launch({}).one_host


def test_torchrun_s_variables():
    got = launch({"WORLD_SIZE": "8", "RANK": "5", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"})
    assert got == Launch(world_size=8, rank=5, local_rank=1, local_world_size=4)
    assert not got.is_main and not got.one_host
    assert launch({"WORLD_SIZE": "2", "RANK": "0", "LOCAL_WORLD_SIZE": "2"}).one_host


@pytest.mark.parametrize("env, match", [({"WORLD_SIZE": "two"}, "WORLD_SIZE='two' is not an integer"),
                                        ({"WORLD_SIZE": "2", "RANK": "2"}, "RANK=2 is not below WORLD_SIZE=2"),
                                        ({"RANK": "-1"}, "RANK=-1 is negative")])
def test_a_broken_launch_environment_is_named(env, match):
    with pytest.raises(ValueError, match=match):
        launch(env)


def test_it_reads_the_process_environment(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "2")
    assert launch().rank == 2 and launch().world_size == 3


def test_only_launch_reads_the_launchers_environment():
    """eagle3.launch is the one place that reads WORLD_SIZE / RANK / LOCAL_RANK / LOCAL_WORLD_SIZE:
    no other module of the library, the stages or the benchmarks reads them from os.environ."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    pattern = re.compile(r"environ(\.get)?[\[(]\s*['\"](WORLD_SIZE|RANK|LOCAL_RANK|LOCAL_WORLD_SIZE)['\"]"
                         r"|['\"](WORLD_SIZE|RANK|LOCAL_RANK|LOCAL_WORLD_SIZE)['\"]\s+in\s+os\.environ")
    found = [f"{p.relative_to(root)}:{i}" for d in ("eagle3", "stages", "bench") for p in sorted((root / d).rglob("*.py"))
             if p.name != "launch.py" for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert found == [], found
    assert pattern.search('int(os.environ.get("RANK", "0"))') and pattern.search("os.environ['LOCAL_RANK']")
