"""`draftsmith bench --endpoint`: two running OpenAI-compatible servers, measured by streaming.

The servers here are small stand-ins on loopback that stream known tokens at known speeds and count
speculative-decoding metrics as vLLM's Prometheus endpoint does; what the bench reads off them is
therefore known: the text, the timings' order, tau and per-position acceptance."""
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from draftsmith.cli import main
from draftsmith.eval.bench_endpoint import base_url, spec_counters


TOKEN_SECONDS = {"plain": 0.006, "speculative": 0.002}
DRAFTS, ACCEPTED, PER_POSITION = 10, 5, [3, 2, 0]     # added per request by the speculative server


class Server:
    """A stand-in for `vllm serve` on a free loopback port."""

    def __init__(self, root: str, mode: str):
        self.root, self.mode, self.requests = root, mode, 0
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, body: bytes, kind: str) -> None:
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                if self.path == "/v1/models":
                    self._send(json.dumps({"data": [{"id": "served", "root": outer.root}]}).encode(), "application/json")
                elif self.path == "/metrics":
                    self._send(outer.metrics().encode(), "text/plain")
                else:
                    self.send_error(404)

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                assert body["stream"] is True and isinstance(body["prompt"], list)
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                for i in range(body["max_tokens"]):
                    token = (sum(body["prompt"]) + 7 * i) % 50 + 3
                    time.sleep(TOKEN_SECONDS[outer.mode])
                    chunk = {"choices": [{"index": 0, "text": f" w{token}", "token_ids": [token]}]}
                    self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                    self.wfile.flush()
                self.wfile.write(b"data: [DONE]\n\n")
                with outer.lock:
                    outer.requests += 1

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def metrics(self) -> str:
        if self.mode == "plain":
            return "# HELP vllm:num_requests_running x\nvllm:num_requests_running 0.0\n"
        n = self.requests
        lines = [f'vllm:spec_decode_num_drafts_total{{engine="0",model_name="served"}} {DRAFTS * n}.0',
                 'vllm:spec_decode_num_drafts_created{engine="0",model_name="served"} 1.7e9',
                 f'vllm:spec_decode_num_accepted_tokens_total{{engine="0",model_name="served"}} {ACCEPTED * n}.0']
        lines += [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="served",position="{p}"}} '
                  f'{a * n}.0' for p, a in enumerate(PER_POSITION)]
        lines += [f'vllm:spec_decode_num_accepted_tokens_per_pos_created{{engine="0",position="{p}"}} 1.7e9'
                  for p in range(3)]
        return "\n".join(lines) + "\n"

    def close(self):
        self.httpd.shutdown()


@pytest.fixture
def servers(tiny_target_dir):
    made = {mode: Server(str(tiny_target_dir), mode) for mode in TOKEN_SECONDS}
    yield made
    for server in made.values():
        server.close()


def traffic(path):
    lines = [{"id": f"code-{i}", "category": "code", "prompt": f"def f{i}(x): return the"} for i in range(3)]
    lines += [{"id": f"chat-{i}", "category": "chat", "prompt": f"the day {i} of the"} for i in range(2)]
    path.write_text("\n".join(json.dumps(line) for line in lines))
    return path


def test_bench_streams_from_two_servers_at_each_load_level(checkpoint, servers, tmp_path):  # noqa: F811
    out = tmp_path / "report"
    argv = ["bench", str(checkpoint), "--endpoint", servers["speculative"].url, "--baseline-endpoint",
            servers["plain"].url, "--prompts", str(traffic(tmp_path / "t.jsonl")), "--limit", "3",
            "--concurrency", "1,2", "--repeats", "2", "--max-new-tokens", "20", "--out", str(out)]
    assert main(argv) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["complete"] is True and report["settings"]["engine"] == "endpoint"
    assert "target checked" in report["engine"]
    assert [level["concurrency"] for level in report["results"]] == [1, 2]
    # 5 requests x 2 modes x 2 levels x 2 repeats, plus one warm-up per server (not in the report)
    assert len(report["runs"]) == 40
    assert servers["plain"].requests == servers["speculative"].requests == 21
    for level in report["results"]:
        groups = level["groups"]
        assert set(groups) == {"chat", "code", "all"}
        every = groups["all"]
        assert every["identical_text"] == 1.0
        # 20 tokens streamed at 6 ms and at 2 ms: about 3x, whatever the loopback adds
        assert every["speedup"] > 1.5, every
        assert every["tau"] == pytest.approx(1 + ACCEPTED / DRAFTS)
        assert every["per_position_acceptance"] == pytest.approx([a / DRAFTS for a in PER_POSITION])
        for mode in ("plain", "speculative"):
            assert 0 < every[mode]["ttft_p50_s"] < every[mode]["total_p50_s"], every[mode]
            assert every[mode]["tokens_per_s_batch"] > 0
    assert all(len(r["tokens"]) == 20 for r in report["runs"])


def test_endpoint_counters_and_urls(servers):
    base = base_url(servers["speculative"].url)
    assert base_url(base + "/") == base == base_url(base + "/v1/")
    servers["speculative"].requests = 2
    counters = spec_counters(base)
    assert counters["vllm:spec_decode_num_drafts"] == 2 * DRAFTS
    assert counters["vllm:spec_decode_num_accepted_tokens_per_pos"] == [2 * a for a in PER_POSITION]


def test_bad_endpoints_are_named(checkpoint, servers, tiny_target_dir, tmp_path, capsys):  # noqa: F811
    common = ["bench", str(checkpoint), "--prompts", str(traffic(tmp_path / "t.jsonl")), "--out", str(tmp_path / "r")]
    assert main(common + ["--endpoint", servers["speculative"].url]) == 2
    assert "--endpoint (the server with the drafter) needs --baseline-endpoint" in capsys.readouterr().err
    assert main(common + ["--endpoint", "localhost:8000", "--baseline-endpoint", servers["plain"].url]) == 2
    assert "an endpoint must be an http(s) URL" in capsys.readouterr().err
    assert main(common + ["--engine", "vllm", "--endpoint", "http://a", "--baseline-endpoint", "http://b"]) == 2
    assert "drop --engine" in capsys.readouterr().err
    # nothing listening
    assert main(common + ["--endpoint", "http://127.0.0.1:9", "--baseline-endpoint", servers["plain"].url]) == 2
    assert "cannot reach http://127.0.0.1:9/v1/models" in capsys.readouterr().err
    # the two servers serve different targets
    other = tmp_path / "other-target"
    other.mkdir()
    config = json.loads((tiny_target_dir / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "hidden_size": config["hidden_size"] * 2}))
    servers["plain"].root = str(other)
    assert main(common + ["--endpoint", servers["speculative"].url, "--baseline-endpoint", servers["plain"].url]) == 2
    err = capsys.readouterr().err
    assert "the two servers serve different targets" in err and str(other) in err and str(tiny_target_dir) in err
    # both serve a target that is not the checkpoint's
    servers["speculative"].root = str(other)
    assert main(common + ["--endpoint", servers["speculative"].url, "--baseline-endpoint", servers["plain"].url]) == 2
    err = capsys.readouterr().err
    assert "the checkpoint was trained for target" in err and str(other) in err and "hidden_size" in err
