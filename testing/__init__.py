"""Test and bench support, never imported by the project's production code (tests/test_layering.py
checks it): fakes of what this machine lacks (`vllm_omni_fake`: vLLM-Omni's AsyncOmni on CPU),
harnesses (`loopback`: a multi-node Ray cluster on 127.0.0.1; `chaos`, `chaos_traffic`: faults on
every stage under load with a trainer attached; `http_servers`: an ASGI app on a local port),
writers of random-init models in their real on-disk formats (`snapshots`: open_clip / CLAP;
`preference_snapshots`: the preference reward models) and what tests and benches share
(`oversized`: request bodies over a graph's bounds; `logprob_reuse`: one FlowGRPO step with the
old log-probs reused or recomputed)."""
