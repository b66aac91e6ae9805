"""A stand-in for `vllm serve` in the tests of benchmarks/vlm_model.VllmServer and train_step's served VLM: an
OpenAI-compatible server on 127.0.0.1 that lists one model and answers every chat completion with the text
"WORD" after --delay seconds; with --exit it exits at once, as a server that fails to start (its console
holding an engine's error and the one it caused, as vLLM's does).

    python tests/fake_openai_server.py [--delay S] [--exit] --port PORT
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from aiohttp import web


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--delay", type=float, default=0.0)
    ap.add_argument("--exit", action="store_true")
    args = ap.parse_args()
    if args.exit:  # as vLLM's console reads when its engine fails: the cause some 40 lines above the end
        print(
            "(EngineCore pid=7) ERROR 12-05 23:10:56 [core.py:1366] ModuleNotFoundError: No module named 'x'"
        )
        for i in range(40):
            print(f'(APIServer pid=6)   File "frame{i}.py", line {i}, in f{i}')
        print("(APIServer pid=6) RuntimeError: Engine core initialization failed. See root cause above.")
        print("fake server: failing to start", flush=True)
        sys.exit(3)

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake", "object": "model"}]})

    async def chat(request: web.Request) -> web.Response:
        await request.json()
        await asyncio.sleep(args.delay)
        return web.json_response({"choices": [{"message": {"role": "assistant", "content": "WORD"}}]})

    app = web.Application(client_max_size=1 << 26)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", chat)
    print("fake server: serving", flush=True)
    web.run_app(app, host="127.0.0.1", port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
