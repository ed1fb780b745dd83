"""`mlcrun bench`: kernel timings (like llama-bench) and serving workloads (like `vllm bench
serve`), offline against the in-process engine or over HTTP against any OpenAI-compatible server.

Layout: workload.py (what to send), metrics.py (what a request's timings mean and their
summaries), kernel.py / offline.py / client.py (the three ways to run), report.py (table, JSON,
plot). Nothing here imports TVM except kernel.py and offline.py, through the runtime.
"""
