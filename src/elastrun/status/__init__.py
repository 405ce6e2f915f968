"""The operator's view: a job's summary read from its store (``elastrun status``)
and its history rebuilt from the agents' event logs (``elastrun timeline``)."""

from elastrun.status.model import JOB_STATES, SUMMARY_VERSION, Summary
from elastrun.status.summary import read_summary, summarize

__all__ = ["JOB_STATES", "SUMMARY_VERSION", "Summary", "read_summary", "summarize"]
