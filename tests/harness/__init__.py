"""What every test imports: builders, servers, process runners and waits, by what they hold.

No test module imports another test module; what two tests share lives here, and the
``conftest.py`` files only turn it into pytest fixtures.

``paths``       the checkout's root; short directories under /tmp (Unix socket paths are short)
``net``         free loopback ports
``waiting``     waiting for a condition until a deadline; several calls at once
``cli``         the ``gpuckpt`` CLI: in this process (typer's runner) or as a subprocess
``agent``       ``gpuckpt agent run`` beside a worker: its config, its start, ``make_cfg``
``repo``        repository builders: blocks, pins, namespaces, repositories, store inspection,
                corrupting stored blocks
``strategies``  hypothesis strategies (any valid :class:`~ckpt.pins.Pins`)
``bounds``      a server run as a subprocess and driven with floods, stalls and huge requests
``models``      tiny random-weight Llamas (with or without a tokenizer) that both engines load
``vllm``        ``vllm serve`` test workers (flags, environment, sampling) and offline worker runs
``sglang``      the SGLang interpreter and test servers with the linker
``seaweed``     a real SeaweedFS S3 server on loopback
``metadata``    fake cloud metadata services (preemption notices)
``workers``     worker sides without an engine process, for the worker conformance suite: vLLM's
                scheduler and the connector's halves on CPU, the SGLang linker on CPU pools
``scripts/``    programs the tests run as processes (an offline vLLM worker, the SGLang linker's
                host, a soak writer)

The worker processes themselves (:class:`agent.testing.ServeProcess`, ``SglangProcess``) are a
shipped kit: :mod:`agent.testing`.
"""
