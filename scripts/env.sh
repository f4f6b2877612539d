# Environment shared by the demo and the tests: stay on loopback, no telemetry, predictable threads.
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
export RAY_USAGE_STATS_ENABLED=0
export RAY_DEDUP_LOGS=0
export MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false
export VLLM_ENABLE_V1_MULTIPROCESSING=0
export TOKENIZERS_PARALLELISM=false
export HF_HUB_OFFLINE=1
export TRANSFORMERS_OFFLINE=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export PYTHONUNBUFFERED=1
# MLflow's telemetry thread mutates os.environ while requests reads it (KeyError seen in a task).
export MLFLOW_DISABLE_TELEMETRY=true
