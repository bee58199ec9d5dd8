"""Test and bench support, never imported by the project's production code (a test checks it):
fakes of what this machine lacks (`vllm_omni_fake`: vLLM-Omni's AsyncOmni on CPU), harnesses
(`loopback`: a multi-node Ray cluster on 127.0.0.1; `http_servers`: an ASGI app on a local port)
and writers of random-init models in their real on-disk formats (`snapshots`: open_clip / CLAP;
`preference_snapshots`: the preference reward models)."""
