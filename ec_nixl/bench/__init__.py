"""``ec-nixl bench``: end-to-end transfer benchmark of the ec-nixl data plane against its peers.

Two processes, a *producer* (the Encode side) and a *consumer* (the Prefill/Decode side), both
spawned here or the producer on another host (``ec-nixl bench producer``, ``--producer``), move
encoder outputs (an ``[num_embeds, width]`` bf16 tensor per image) between them. For each
size, in one run and between the same two processes, the consumer times (medians and p99 over
repeats, warm-up excluded, every item's bytes checked) each path of ``paths``: ours-read,
ours-write and staged-write (ec-nixl's public API), raw-nixl-read/-write (plain NIXL: the floor),
reference-copy (the physical copy), host-bounce, file and ucx (the other connectors' data paths).
It also measures the CPU cost of the idle, handshaken pair and of the pair under load, the
barrier pass on items that already landed, and the copy bandwidth. Goals are printed as ratios
of numbers from the same run; they are reported, never asserted.

Reading order (one module per concern):

    command       options -> plan, exit status            orchestrator  spawn, follow, clean up
    producer      the Encode process (commands)           consumer      the P/D process (cases)
    paths/        one module per family of paths          idle          CPU seconds per wall second
    report        table, CPU table, JSON                  goals         the goal lines
    plot          --plot (matplotlib)                     progress      tqdm or plain lines
    memory        source buffer, patterns, checks         proc          pipes, watchdogs, tmpdir
    units         sizes, percentiles, formatting          optional      imports that may be missing
    remote        the producer on another host            wire          its TCP control channel

Only ``ec_nixl``'s public API is used (``Endpoint``, ``EndpointConfig``, ``ItemRef``,
``LoadBarrier``): what the bench measures is what a user gets.

The entry point is ``ec_nixl.bench.command.main``; this package module imports nothing, so that
its submodules can import each other through it without a circle.
"""
