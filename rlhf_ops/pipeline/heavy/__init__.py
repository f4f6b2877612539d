"""The pipeline's built-in heavy jobs, one module each: request model, result model and body (``@pipeline_job``).

:data:`rlhf_ops.pipeline.job_requests.PIPELINE_JOBS` imports every module here when it is first read, so a new
module is found without an import anywhere; its task is one ``heavy(...)`` call in the provider's DAG factory.
Torch-free: a body imports the heavy library when it runs (on the Ray cluster).
"""
