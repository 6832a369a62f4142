"""Typed messages of the environment protocol (paper App. B.1), JSON over HTTP.

    POST /start         StartRequest{env, task, seed}
                          -> StartResponse{session, observation, messages, tools, info}
    POST /observation   ObservationRequest{session, action}
                          -> ObservationResponse{observation, messages, reward, done, info}
    POST /end|/pause|/resume   SessionRequest{session}  -> SessionResponse{session, state}
    POST /batch         BatchRequest{calls: [{call, body}]}
                          -> one BatchAnswer{index, status, body} line per call (NDJSON), each
                             as soon as its call is done

Messages are OpenAI-style chat messages (:class:`Message`, with :class:`ToolCall`); ``tools``
are OpenAI tool schemas (``{"type": "function", "function": {name, description, parameters}}``).
The server always fills both forms of an observation: ``messages`` (a plain-text environment's
observation is one user message; a start may open with a system message; a step answers with
tool results and/or user text) and ``observation``, the same contents as plain text (joined by
newlines) for clients without a chat template. The action is the model's raw text; the
environment parses tool calls out of it (:mod:`tiderl.env.tools`).

A message's ``content`` is a string or a list of OpenAI-style content parts, what vLLM's and
SGLang's OpenAI chat APIs take:

    "higher . 17 turns left ."                                  (on the wire exactly as before)
    [{"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBOR..."}},
     {"type": "text", "text": "Click the red button."}]

Images are PNG data URLs only, checked by :mod:`tiderl.env.images` (size in bytes and pixels,
the PNG header), at most ``MAX_IMAGES_PER_MESSAGE`` a message. Consumers read a message through
:meth:`Message.text` (the parts' text joined by newlines, each image as ``IMAGE_MARKER``) and
:meth:`Message.images` (the PNG bytes, in order); producers build parts with :func:`image_part`.
The plain-text ``observation`` shows each image as ``IMAGE_MARKER``.

Errors are ``{"error": {"message", "type"}}`` with a 4xx status (see :mod:`tiderl.env.server`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from tiderl.core.quote import short
from tiderl.env.images import ImageError, decode_png_data_url, png_data_url

MAX_ACTION_CHARS = 65536  # an agent's turn may be long; the body limit is 1 MiB
MAX_TASK_CHARS = 4096
MAX_SESSION_CHARS = 128
Seed = Annotated[int, msgspec.Meta(ge=-(2 ** 63), le=2 ** 63 - 1)]  # what a JSON peer can send


Owner = Annotated[str, msgspec.Meta(max_length=64)]


# a job's task and group ids: an agent's endpoint path holds its task's
TaskName = Annotated[str, msgspec.Meta(max_length=128, pattern=r"^[A-Za-z0-9._:-]*$")]


class StartRequest(msgspec.Struct, forbid_unknown_fields=True):
    """``owner``: who holds the session (a job's rank: ``rank-3``), so that the job can end
    every session of a rank that died (``/end_owner``) instead of leaving them to expire.
    ``task_id``, ``group_id``: the job's names of the task (an agent's endpoint is named by
    its task)."""

    env: str
    task: str | None = None
    seed: Seed = 0
    owner: Owner = ""
    task_id: TaskName = ""
    group_id: TaskName = ""


ROLES = ("system", "user", "assistant", "tool")


class ToolFunction(msgspec.Struct):
    """The function a tool call names; ``arguments`` is JSON text, as OpenAI sends it (a
    malformed call keeps the text it had, see :func:`tiderl.env.tools.parse_tool_calls`)."""

    name: str
    arguments: str


class ToolCall(msgspec.Struct):
    id: str
    function: ToolFunction
    type: str = "function"


MAX_IMAGES_PER_MESSAGE = 10  # the paper's GUI runs keep at most ten screenshots in a context
IMAGE_MARKER = "<image>"  # an image in the plain-text form of a message


class TextPart(msgspec.Struct, tag_field="type", tag="text"):
    """``{"type": "text", "text": ...}``"""

    text: str


class ImageURL(msgspec.Struct):
    """``{"url": "data:image/png;base64,..."}``, checked when built or decoded
    (:func:`tiderl.env.images.decode_png_data_url`); other OpenAI fields (``detail``) are
    ignored."""

    url: str

    def __post_init__(self) -> None:
        decode_png_data_url(self.url)


class ImagePart(msgspec.Struct, tag_field="type", tag="image_url"):
    """``{"type": "image_url", "image_url": {"url": ...}}``"""

    image_url: ImageURL

    @property
    def png(self) -> bytes:
        return decode_png_data_url(self.image_url.url)


ContentPart = TextPart | ImagePart


def image_part(png: bytes) -> ImagePart:
    """The content part of a PNG image; :class:`~tiderl.env.images.ImageError` if the image
    breaks the limits of :mod:`tiderl.env.images`."""
    return ImagePart(ImageURL(png_data_url(png)))


class Message(msgspec.Struct, omit_defaults=True):
    """One OpenAI-style chat message. ``content``: a string, or content parts (text and PNG
    images, at most ``MAX_IMAGES_PER_MESSAGE`` images); ``tool_calls`` only on an assistant
    message; ``tool_call_id`` and ``name`` (the function's) only on a tool message. Checked on
    construction and on decoding (a wrong role, field or image is a ``ValueError`` /
    ``msgspec.ValidationError``; a bad image an :class:`~tiderl.env.images.ImageError`)."""

    role: str  # one of ROLES
    content: str | list[ContentPart] = ""
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role: expected one of {', '.join(ROLES)}, got {short(self.role)}")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"tool_calls: only an assistant message has them, not {self.role}")
        if self.role != "tool" and (self.tool_call_id is not None or self.name is not None):
            raise ValueError(f"tool_call_id, name: only a tool message has them, not {self.role}")
        if not isinstance(self.content, str):
            for part in self.content:
                if not isinstance(part, ContentPart):
                    raise TypeError(f"content: expected a string or TextPart and ImagePart "
                                    f"items, got a {type(part).__name__}")
            if self.num_images > MAX_IMAGES_PER_MESSAGE:
                raise ImageError(f"content: {self.num_images} images in one message, more "
                                 f"than the limit ({MAX_IMAGES_PER_MESSAGE})")

    @property
    def num_images(self) -> int:
        if isinstance(self.content, str):
            return 0
        return sum(isinstance(part, ImagePart) for part in self.content)

    def text(self, image_marker: str = IMAGE_MARKER) -> str:
        """The content as text: a string as is; parts joined by newlines (as vLLM joins them),
        each image shown as ``image_marker`` (``""``: images left out)."""
        if isinstance(self.content, str):
            return self.content
        texts = (part.text if isinstance(part, TextPart) else image_marker
                 for part in self.content)
        return "\n".join(text for text in texts if text)

    def images(self) -> list[bytes]:
        """The PNG bytes of the content's images, in order (none for a string)."""
        if isinstance(self.content, str):
            return []
        return [part.png for part in self.content if isinstance(part, ImagePart)]


def messages_text(messages: list[Message]) -> str:
    """The plain-text form of messages: their non-empty texts (:meth:`Message.text`, each
    image as ``IMAGE_MARKER``) joined by newlines."""
    return "\n".join(text for m in messages if (text := m.text()))


class StartResponse(msgspec.Struct):
    """An agent session's (``agent``) opening is its agent's first model request: its messages
    and tools, or its token ids (``prompt_ids``), and the sampling it asks for (``sampling``:
    ``max_tokens``, ``stop``, ``seed``)."""

    session: str
    observation: str
    info: dict[str, Any] = msgspec.field(default_factory=dict)
    messages: list[Message] = msgspec.field(default_factory=list)
    tools: list[dict[str, Any]] = msgspec.field(default_factory=list)
    agent: bool = False
    prompt_ids: list[int] | None = None
    sampling: dict[str, Any] = msgspec.field(default_factory=dict)


class Completion(msgspec.Struct, forbid_unknown_fields=True):
    """The model's answer to an agent's request, as the rank sampled it (sent with
    ``/observation`` on an agent session; the action is its text). ``error``: the rank could
    not serve the request (a prompt over the context length): the agent is answered 400 with
    it, and the task goes on. ``stop``: the stop string that ended the text, if one did."""

    token_ids: list[int] = msgspec.field(default_factory=list)
    logprobs: list[float] = msgspec.field(default_factory=list)
    finish_reason: str = "stop"  # "stop" | "length"
    prompt_tokens: int = 0
    cached_tokens: int = 0
    version: int = 0
    stop: str = ""
    error: str = ""


class ObservationRequest(msgspec.Struct, forbid_unknown_fields=True):
    session: str
    action: str
    completion: Completion | None = None


class ObservationResponse(msgspec.Struct):
    """``messages``: what follows the model's action (tool results and/or user text). On an
    agent session, the agent's next request: the messages (or ``prompt_ids``) new since the
    answer, or, ``restart``, the whole request, which the rank renders from scratch (with
    ``tools``) as a new training segment; ``sampling`` as in :class:`StartResponse`."""

    observation: str
    reward: float
    done: bool
    info: dict[str, Any] = msgspec.field(default_factory=dict)
    messages: list[Message] = msgspec.field(default_factory=list)
    restart: bool = False
    tools: list[dict[str, Any]] = msgspec.field(default_factory=list)
    prompt_ids: list[int] | None = None
    sampling: dict[str, Any] = msgspec.field(default_factory=dict)


class SessionRequest(msgspec.Struct, forbid_unknown_fields=True):
    """The body of /end, /pause and /resume."""

    session: str


EndRequest = PauseRequest = ResumeRequest = SessionRequest


class OwnerRequest(msgspec.Struct, forbid_unknown_fields=True):
    """The body of /end_owner: end every session ``owner`` started."""

    owner: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]


class OwnerResponse(msgspec.Struct):
    owner: str
    ended: int


class SessionResponse(msgspec.Struct):
    session: str
    state: str  # "ended", "paused" or "active"


BATCH_CALLS = ("/start", "/observation", "/end", "/pause", "/resume")
MAX_BATCH_CALLS = 1024


class BatchCall(msgspec.Struct, forbid_unknown_fields=True):
    """One call of a batch: the route it stands for and that route's body, as is."""

    call: Literal["/start", "/observation", "/end", "/pause", "/resume"]  # BATCH_CALLS
    body: msgspec.Raw


class BatchRequest(msgspec.Struct, forbid_unknown_fields=True):
    """The body of /batch: calls the server runs concurrently, each exactly as its route would
    (its own errors, metrics and latency model)."""

    calls: Annotated[list[BatchCall], msgspec.Meta(min_length=1, max_length=MAX_BATCH_CALLS)]


class BatchAnswer(msgspec.Struct, omit_defaults=True):
    """One line of /batch's answer: call ``index``'s status and body, what its route would have
    answered (an error as ``{"error": {"message", "type"}}``); ``retry_after_s``: its
    ``Retry-After`` (a 429)."""

    index: int
    status: int
    body: msgspec.Raw
    retry_after_s: float | None = None


def decode(body: bytes, kind: type[msgspec.Struct]) -> Any:
    """Decode and check one request body; raises :class:`ProtocolError` with a clear message."""
    try:
        msg = msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        raise ProtocolError(str(exc)) from exc
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"malformed JSON: {exc}", "malformed_json", 400) from exc
    except RecursionError:  # msgspec's answer to a very deep nesting
        raise ProtocolError("malformed JSON: nested too deep", "malformed_json", 400) from None
    check_limits(msg)
    return msg


def check_limits(msg: msgspec.Struct) -> None:
    """Length limits the types alone do not express."""
    action = getattr(msg, "action", None)
    if action is not None and len(action) > MAX_ACTION_CHARS:
        raise ProtocolError(f"action: {len(action)} characters, longer than the limit "
                            f"({MAX_ACTION_CHARS})")
    task = getattr(msg, "task", None)
    if task is not None and len(task) > MAX_TASK_CHARS:
        raise ProtocolError(f"task: {len(task)} characters, longer than the limit "
                            f"({MAX_TASK_CHARS})")
    session = getattr(msg, "session", None)
    if session is not None and not 0 < len(session) <= MAX_SESSION_CHARS:
        raise ProtocolError(f"session: expected 1 to {MAX_SESSION_CHARS} characters")


class ProtocolError(ValueError):
    """A request that does not fit the protocol (answered 400/422)."""

    def __init__(self, message: str, kind: str = "invalid_request", status: int = 422):
        super().__init__(message)
        self.kind = kind
        self.status = status
