"""What every route of one app shares: the backend, the settings, admission and metrics."""

from __future__ import annotations

import time

from fastapi import Request

from coordinator.api.admission import Admission
from coordinator.api.client import EngineClient
from coordinator.api.errors import ApiError
from coordinator.api.logprobs import TokenTexts
from coordinator.api.metrics import ServerMetrics
from coordinator.api.settings import ServerSettings


class ServerContext:
    def __init__(self, client: EngineClient, settings: ServerSettings) -> None:
        self.client = client
        self.settings = settings
        self.created = int(time.time())
        self.admission = Admission(settings.max_queue, settings.retry_after_s)
        self.metrics = ServerMetrics(
            client.model_name,
            client.stats,
            lambda: self.admission.num_waiting,
            client.pools,
            getattr(client, "handover", None),  # disaggregated backends time the KV handover
            getattr(client, "planner", None),  # and may run the SLO planner
        )
        self.token_texts = TokenTexts(client.tokenizer)

    def check_model(self, model: str | None) -> None:
        """A request may name the served model or none; any other name is a 404."""
        if model is not None and model != self.client.model_name:
            raise ApiError(
                404,
                f"the model {model!r} does not exist; this server serves "
                f"{self.client.model_name!r}",
                param="model",
                code="model_not_found",
            )


def context_of(request: Request) -> ServerContext:
    return request.app.state.tandem
