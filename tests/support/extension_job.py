"""A throw-away heavy pipeline job, outside the package, named by dotted path as a user's package would be.

One module is the whole job: its request (built from the task's values and the trigger form), its result, its
body and its Asset. It stays torch-free at import, as a job module must: the Airflow side imports it too.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlhf_ops.pipeline.job_requests import JobRequest, JobResult, JobSkipped, RunRef, pipeline_job

if TYPE_CHECKING:
    from rlhf_ops.pipeline.params import PipelineParams


class CountWordsRequest(JobRequest):
    text: str
    preset: str

    @classmethod
    def from_task(cls, values: Mapping[str, Any], *, params: PipelineParams, run: RunRef) -> CountWordsRequest:
        """``values["text"]`` from the DAG, the preset from the form; nothing to count: skipped."""
        if not values.get("text"):
            raise JobSkipped("no text to count")
        return cls(run=run, text=str(values["text"]), preset=params.preset)

    def event_extra(self, result: Mapping[str, Any]) -> dict[str, Any]:
        return {"words": result["words"], "preset": self.preset}


class CountWordsResult(JobResult):
    words: int
    written: str


@pipeline_job("count_words", request=CountWordsRequest, result=CountWordsResult, asset="word_count")
def count_words(request: CountWordsRequest) -> dict[str, Any]:
    """Counts the words and writes the count into the run's folder (on the Ray side)."""
    folder = Path(request.run.layout().local_run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    written = folder / "word_count.txt"
    words = len(request.text.split())
    written.write_text(f"{words}\n")
    return {"words": words, "written": str(written)}
