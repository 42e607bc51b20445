"""Two nodes simulated on one machine: `torchrun --nnodes 2` on localhost, one process per "node", each
node in a working directory of its own.  With output_dir on a path both see, data and training complete
and equal a one-node run; with node-local paths, every rank refuses before any work."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import tiny_recipe

REPO = Path(__file__).resolve().parents[1]


def two_nodes(tmp_path, port: int, *argv) -> list[subprocess.CompletedProcess]:
    """`torchrun --nnodes 2 --nproc_per_node 1 --node_rank R -m draftsmith ARGV` for R = 0, 1, node R in
    tmp_path/node-R (its own working directory)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", ACCELERATE_USE_CPU="true",
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    procs = []
    for rank in (0, 1):
        cwd = tmp_path / f"node-{rank}"
        cwd.mkdir(exist_ok=True)
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1", "--node_rank",
             str(rank), "--master_addr", "127.0.0.1", "--master_port", str(port), "-m", "draftsmith", *map(str, argv)],
            cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    done = []
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return done


@pytest.fixture(scope="module")
def recipe(tiny_target_dir, tmp_path_factory):
    work = tmp_path_factory.mktemp("two-nodes")
    raw = tiny_recipe(work, tiny_target_dir, epochs=2, log_every=1, eval_prompts=1, eval_max_new_tokens=8)
    path = work / "recipe.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.mark.multiprocess
def test_two_nodes_on_a_shared_output_dir_equal_one_node(recipe, tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    one, shared = tmp_path / "one", tmp_path / "shared"
    for verb, extra in (("data", []), ("train", ["train.batch_size=8"])):
        done = subprocess.run([sys.executable, "-m", "draftsmith", verb, str(recipe), f"output_dir={one}", *extra],
                              env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
    for verb, extra, port in (("data", [], 29621), ("train", ["train.batch_size=4"], 29622)):
        nodes = two_nodes(tmp_path, port, verb, recipe, f"output_dir={shared}", *extra)
        assert [n.returncode for n in nodes] == [0, 0], nodes[0].stderr[-2000:] + nodes[1].stderr[-2000:]

    def records(run):
        rows = []
        for shard in sorted((run / "data" / "shards").glob("*.jsonl")):
            rows += [(r["id"], r["input_ids"]) for r in map(json.loads, shard.read_text().splitlines())]
        return sorted(rows)
    assert records(shared) == records(one)            # node 1's shards are there, the same as one node's
    losses = [[r["train/loss"] for r in map(json.loads, (run / "logs" / "train.jsonl").read_text().splitlines())
               if "train/loss" in r] for run in (one, shared)]
    assert len(losses[0]) == len(losses[1]) >= 4
    for a, b in zip(*losses):
        assert abs(a - b) <= 1e-4 * abs(a), losses
    replicas = json.loads((shared / "logs" / "replicas.json").read_text())["processes"]
    assert replicas[0]["weights_sha256"] == replicas[1]["weights_sha256"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("verb", ["data", "train"])
def test_node_local_output_dirs_are_refused_on_every_rank_before_any_work(recipe, tmp_path, verb):
    """output_dir=run is relative: each node resolves it in its own working directory, as two nodes with
    local disks would.  Both ranks stop with the one line, and node 1 wrote nothing."""
    nodes = two_nodes(tmp_path, 29623 + (verb == "train"), verb, recipe, "output_dir=run")
    for node in nodes:
        assert node.returncode != 0
        assert "is not shared by every process of this launch: rank 1" in node.stderr, node.stderr[-2000:]
        assert "must be on a filesystem every node mounts" in node.stderr
    left = sorted(p.name for p in (tmp_path / "node-1" / "run").rglob("*")) if (tmp_path / "node-1" / "run").exists() else []
    assert not [name for name in left if name.endswith((".jsonl", ".safetensors"))], left


def test_processes_with_different_recipes_are_named_by_the_first_key(tmp_path):
    """The comparison behind the refusal: the first differing key, both values."""
    from draftsmith.heads.infra.launch_checks import first_difference

    a = {"train": {"lr": 0.001, "batch_size": 4}, "data": {"seed": 0}, "method": "medusa"}
    b = {"train": {"lr": 0.01, "batch_size": 4}, "data": {"seed": 0}, "method": "medusa"}
    assert first_difference(a, b) == ("train.lr", 0.001, 0.01)
    assert first_difference(a, a) is None
    assert first_difference({"x": 1}, {}) == ("x", 1, "<absent>")


@pytest.mark.multiprocess
def test_an_override_given_to_one_node_only_is_refused_on_every_rank(recipe, tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", ACCELERATE_USE_CPU="true")
    shared = tmp_path / "shared"
    procs = []
    for rank, extra in ((0, []), (1, ["train.lr=0.5"])):
        cwd = tmp_path / f"node-{rank}"
        cwd.mkdir()
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1", "--node_rank",
             str(rank), "--master_addr", "127.0.0.1", "--master_port", "29625", "-m", "draftsmith", "data", str(recipe),
             f"output_dir={shared}", *extra], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for proc in procs:
        _, err = proc.communicate(timeout=600)
        assert proc.returncode != 0
        assert "hold different recipes: train.lr is 0.01 on rank 0 and 0.5 on rank 1" in err, err[-2000:]
    assert not list((shared / "shards").glob("*.jsonl")) if (shared / "shards").exists() else True
