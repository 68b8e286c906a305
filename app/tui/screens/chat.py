"""The chat: load the chosen model with progress, then talk to it.

Generation runs in a thread worker that posts each ``TextPiece`` as a ``Streamed`` message
and the final ``Done`` as ``Answered``; the screen appends pieces to the answer's Markdown
stream in arrival order (message queues keep it) and renders the whole text once at the
end. Esc sets the cancel token; the backend then ends with ``Done("cancelled")`` and the
text generated so far stays, in the view and in the history.

A conversation longer than the model's context leaves out its oldest turns (the system
prompt stays; a setting, Ctrl+S) and says so; a message that does not fit even alone is not
kept as sent: it goes back into the input, with the keys that help.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.message import Message
from textual.screen import Screen
from textual.widgets import Footer, Label, ProgressBar

from hybridmoe.app.history import Conversation, HistoryError, title_for
from hybridmoe.app.model_service import LoadedModel
from hybridmoe.app.server.shared_session import SharedSession
from hybridmoe.app.tui.screens.chat_settings import ChatSettings, ChatSettingsScreen, sampling_params
from hybridmoe.app.tui.screens.conversations import ConversationsScreen
from hybridmoe.app.tui.widgets.chat_message import ChatMessage, code_blocks
from hybridmoe.app.tui.widgets.prompt import PromptInput
from hybridmoe.app.tui.widgets.status_line import StatusLine
from hybridmoe.app.tui.widgets.nav_bar import NavBar
from hybridmoe.app.tui.workers import ReportsWorkerErrors, WorkerFailed
from hybridmoe.backend.errors import HybridMoeError, PromptTooLongError
from hybridmoe.backend.plan import ExpertStats, Plan
from hybridmoe.backend.session import Cancelled, CancelToken, Done, Message as ChatTurn, Progress, TextPiece

FINISH_NOTES = {"stop": "", "length": "stopped at the token limit", "cancelled": "stopped", "error": "failed"}


class ChatScreen(ReportsWorkerErrors, Screen):
    # Short descriptions for the footer, the full names (tooltips) for the command palette.
    # The footer shows what a conversation needs at 80 columns; copying a code block and
    # reloading are in the palette (Ctrl+P), and the status line names Ctrl+L when a load failed.
    BINDINGS = [
        Binding("escape", "stop", "Stop", tooltip="Stop generating (keeps the text)"),
        Binding("ctrl+r", "regenerate", "Retry", tooltip="Regenerate the last answer"),
        Binding("ctrl+n", "new_chat", "New", tooltip="New conversation"),
        Binding("ctrl+o", "conversations", "History", tooltip="Conversations: reopen or delete"),
        Binding("ctrl+s", "settings", "Settings", tooltip="Chat settings: system prompt, sampling, usage recording"),
        Binding("ctrl+t", "copy_answer", "Copy", tooltip="Copy the last answer"),
        Binding("ctrl+b", "copy_code", "Code", show=False, tooltip="Copy the last code block"),
        Binding("ctrl+l", "reload", "Reload", show=False, tooltip="Reload the model"),
    ]

    # ---- messages from the workers ---------------------------------------------------------------

    class LoadProgressed(Message):
        def __init__(self, progress: Progress):
            super().__init__()
            self.progress = progress

    class Loaded(Message):
        def __init__(self, loaded: LoadedModel):
            super().__init__()
            self.loaded = loaded

    class LoadStopped(Message):
        def __init__(self, target: tuple, message: str):
            super().__init__()
            self.target, self.message = target, message

    class Unloaded(Message):
        """The model service closed the model for other work (``why``: "for the benchmark")."""

        def __init__(self, why: str):
            super().__init__()
            self.why = why

    class Streamed(Message):
        def __init__(self, text: str, tokens: int):
            super().__init__()
            self.text, self.tokens = text, tokens

    class Answered(Message):
        """The answer ended; ``done`` is None when it was stopped before it had its turn."""

        def __init__(self, done: Done | None):
            super().__init__()
            self.done = done

    class TurnsLeftOut(Message):
        """The answer's prompt left out the conversation's oldest ``count`` messages."""

        def __init__(self, count: int):
            super().__init__()
            self.count = count

    class UsageNotRecorded(Message):
        def __init__(self, error: HybridMoeError):
            super().__init__()
            self.error = error

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        # What the loaded model had counted when its usage was last accounted for; touched
        # only by the generate worker (one at a time) and by a load (never during an answer).
        self._counted: ExpertStats | None = None
        self.loading_target: tuple | None = None
        self.failed_target: tuple | None = None  # not retried on its own (Ctrl+L does)
        self.load_cancel = CancelToken()
        # The model this chat last loaded: its conversations' model and the plan its figures
        # are compared with. They stay when the model is unloaded (for a benchmark, say).
        self.model_path: Path | None = None
        self.plan: Plan | None = None
        self.generating = False
        self.cancel = CancelToken()
        self.answer: ChatMessage | None = None
        # The user's message the answer in progress answers, when it was just sent (not for a
        # regenerated answer): taken back into the input when it cannot be answered at all.
        self.sent: ChatMessage | None = None
        self.conversation: Conversation | None = None
        # The history's generation the conversation and the message ids belong to: a new
        # history that replaced a damaged one holds none of them.
        self._history_generation = 0
        self._told_unsaved = False  # a failed write was said once; said again after a success
        self.system_prompt = ""
        self.context_used = 0
        self._t0 = 0.0
        self._first_token_s: float | None = None
        self._tokens = 0

    def compose(self) -> ComposeResult:
        yield NavBar("chat")
        with Vertical(id="load-panel"):
            yield Label("", id="load-title")
            yield ProgressBar(total=None, show_eta=False, id="load-bar")
        yield VerticalScroll(id="conversation")
        yield StatusLine(id="status")
        yield PromptInput(id="prompt", placeholder="Message (Enter sends, Shift+Enter or Ctrl+J: new line)")
        yield Footer(compact=True)

    def on_mount(self) -> None:
        models = self.app.models
        models.keep_while(lambda: "the chat is answering: stop it (Esc) or let it finish first"
                          if self.generating else "")
        models.when_unloaded(lambda why: self.post_message(self.Unloaded(why)))
        self.system_prompt = self.app.state.system_prompt
        self.query_one("#conversation", VerticalScroll).anchor()
        self.query_one("#load-panel").display = False
        self.query_one(PromptInput).focus()

    def on_screen_resume(self) -> None:
        self.ensure_loaded()

    # ---- the model, as the App's model service holds it --------------------------------------------

    @property
    def session(self):
        """Where the chat's answers go (the API server's shared queue while it serves the
        model); None when no model is loaded, or while the chat loads one (until it has
        shown it ready)."""
        return None if self.loading_target is not None else self.app.models.session

    @property
    def loaded_session(self):
        """The session as the backend made it: only the backend's own one counts experts."""
        loaded = self.app.models.loaded
        return loaded.session if loaded is not None else None

    @property
    def loaded_target(self) -> tuple | None:
        loaded = self.app.models.loaded
        return loaded.target if loaded is not None else None

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "stop":
            return self.generating or self.loading_target is not None
        if action == "regenerate":  # hidden while answering: the footer needs the room for Stop
            return not self.generating and self._last("assistant") is not None
        if action == "reload":  # hidden while answering: the footer needs the room for Stop
            return not self.generating
        return True

    # ---- loading -----------------------------------------------------------------------------------

    def ensure_loaded(self) -> None:
        """Load the App's current model and plan unless they are loaded (or loading) already."""
        target = (self.app.model, self.app.plan)
        status = self.query_one(StatusLine)
        if not self.app.model:
            status.say("No model chosen yet: F6 runs the setup, F3 picks a model on disk.")
            return
        if target in (self.loaded_target, self.loading_target, self.failed_target):
            return
        if self.generating:  # the answer stops first; the new model loads when it has (_finish_answer)
            self.cancel.cancel()
            return
        self.load(target)

    def load(self, target: tuple) -> None:
        self.loading_target = target
        self.load_cancel = CancelToken()
        panel = self.query_one("#load-panel")
        panel.display = True
        self.query_one("#load-title", Label).update(f"Loading {Path(target[0]).name} …  (Esc cancels)")
        self.query_one("#load-bar", ProgressBar).update(total=None, progress=0)
        self.query_one(StatusLine).say("loading")
        self.refresh_bindings()
        self._load(target, self.app.hardware, self.app.settings, self.load_cancel)

    @work(thread=True, exclusive=True, exit_on_error=False, group="load")
    def _load(self, target: tuple, hardware, settings, cancel: CancelToken) -> None:
        model, plan = target
        try:
            loaded = self.app.models.load(
                model, plan, hardware=hardware, settings=settings,
                on_progress=lambda p: self.post_message(self.LoadProgressed(p)), cancel=cancel,
                on_notice=lambda text: self.app.call_from_thread(self.notify, text, timeout=10),
            )
        except Cancelled as stopped:
            self.post_message(self.LoadStopped(target, stopped.what))
            return
        self.post_message(self.Loaded(loaded))

    def on_chat_screen_load_progressed(self, event: LoadProgressed) -> None:
        p = event.progress
        bar = self.query_one("#load-bar", ProgressBar)
        if p.total:
            bar.update(total=p.total, progress=p.done)
        if p.message:
            self.query_one(StatusLine).say("loading", p.message)

    async def on_chat_screen_loaded(self, event: Loaded) -> None:
        loaded = event.loaded
        if loaded.target != self.loading_target:  # superseded: the service closes it for the next load
            return
        self.model_path, self.plan, self._counted = loaded.path, loaded.plan, None
        self.loading_target = None
        self.query_one("#load-panel").display = False
        status = self.query_one(StatusLine)
        status.model_name = self.model_name
        status.say("ready", limits_words(loaded.session.max_parallel, loaded.plan.workload.context),
                   "CPU only" if loaded.plan.main_device == "cpu" else "", loaded.session.decode_path)
        self.refresh_bindings()
        self.query_one(PromptInput).focus()
        if self.app.settings.record_stats and not loaded.session.counts_experts:
            self.notify("llama.cpp does not report which experts it uses: usage is not recorded with this model.",
                        severity="warning", timeout=10)

    def on_chat_screen_unloaded(self, event: Unloaded) -> None:
        """The model went for other work; the chat loads it again when shown."""
        self._counted = None
        self.query_one(StatusLine).say(f"unloaded {event.why}; it loads again when you come back to the chat")
        self.refresh_bindings()

    def on_chat_screen_load_stopped(self, event: LoadStopped) -> None:
        if event.target != self.loading_target:  # a load another one replaced: that one goes on
            return
        self.loading_target = None
        self.query_one("#load-panel").display = False
        self.query_one(StatusLine).say(f"{event.message}; Ctrl+L loads it again")
        self.refresh_bindings()

    @property
    def model_name(self) -> str:
        return self.plan.model if self.plan else (self.model_path.name if self.model_path else "")

    def action_reload(self) -> None:
        if self.generating:
            self.notify("Stop the answer first (Esc).", severity="warning")
            return
        if self.app.model:
            self.failed_target = None
            self.load((self.app.model, self.app.plan))  # the service closes the loaded copy first

    # ---- sending and generating ------------------------------------------------------------------

    async def on_prompt_input_submitted(self, event: PromptInput.Submitted) -> None:
        event.stop()
        if self.session is None:
            self.notify("The model is not loaded yet; your message is kept.", severity="warning")
            return
        if self.generating:
            self.notify("Still answering: Esc stops it.", severity="warning")
            return
        event.prompt.clear()
        sent = await self._add_user_message(event.text)
        await self._start_answer()
        self.sent = sent

    async def _add_user_message(self, text: str) -> ChatMessage:
        log = self.query_one("#conversation", VerticalScroll)
        message = ChatMessage("user", text)
        await log.mount(message)  # on screen first: a failed save cannot lose it
        log.anchor()  # whoever sends wants to see the answer, even after scrolling up
        self._save()
        return message

    # ---- keeping the conversation in the history -------------------------------------------------

    def _in_history(self) -> bool:
        """Whether the conversation on screen has a row in the history now open."""
        return self.conversation is not None and self._history_generation == self.app.history.generation

    def _store_unsaved(self) -> None:
        """Add the messages on screen the history lacks, in order (an answer still being
        generated waits for its end)."""
        history = self.app.history
        if not self._in_history():  # a new conversation, or a new history: all of it goes in
            self.conversation = None
            self._history_generation = history.generation
            for message in self.query(ChatMessage):
                message.message_id = None
        messages = [m for m in self.query(ChatMessage) if m is not self.answer]
        if not messages:
            return
        if self.conversation is None:
            first = next((m.text for m in messages if m.role == "user"), "New conversation")
            self.conversation = history.create(str(self.model_path), self.system_prompt, title_for(first))
        for message in messages:
            if message.message_id is None:
                message.message_id = history.add(self.conversation.id, message.role, message.text,
                                                 finish_reason=message.finish_reason, stats=message.stats).id

    def _save(self) -> None:
        try:
            self._store_unsaved()
            self._told_unsaved = False
        except HistoryError as error:
            self._history_failed(error)

    def _history_failed(self, error: HistoryError) -> None:
        """Say what failed and what is kept. The conversation stays on screen whatever
        happens; after a new history replaced a damaged one, it is stored in that one."""
        if error.replaced:
            try:
                self._store_unsaved()
                kept = ("Nothing on screen was lost: this conversation, your last message included, "
                        "is in the new history.")
                self._told_unsaved = False
            except HistoryError as again:
                kept = f"This conversation stays on screen but is not saved ({again.what})."
                self._told_unsaved = True
        elif self._told_unsaved:  # the same trouble again: said once is enough
            return
        else:
            kept = ("This conversation stays on screen; it is saved with your next message if the "
                    "history can be written then.")
            self._told_unsaved = True
        self.app.show_error(HybridMoeError(error.what, f"{kept} {error.hint}"))

    def _turns(self) -> list[ChatTurn]:
        turns = [ChatTurn("system", self.system_prompt)] if self.system_prompt.strip() else []
        turns += [ChatTurn(m.role, m.text) for m in self.query(ChatMessage)]
        return turns

    async def _start_answer(self) -> None:
        turns = self._turns()
        self.sent = None
        self.answer = ChatMessage("assistant", author=self.model_name)
        await self.query_one("#conversation", VerticalScroll).mount(self.answer)
        self.answer.begin_stream()
        self.generating = True
        self.cancel = CancelToken()
        self._t0, self._first_token_s, self._tokens = time.monotonic(), None, 0
        self.query_one(StatusLine).show_live(0, 0.0, None)
        self.refresh_bindings()
        self._generate(self.session, turns, dict(self.app.state.sampling), self.cancel,
                       self.loaded_session, self.model_path, self.app.settings.record_stats,
                       self.app.state.drop_oldest_turns)

    @work(thread=True, exclusive=True, exit_on_error=False, group="generate")
    def _generate(self, session, turns: list[ChatTurn], sampling_values: dict, cancel: CancelToken,
                  counter, model_path: Path, record_usage: bool, drop_oldest_turns: bool) -> None:
        services = self.app.services
        sampling = sampling_params(sampling_values)  # here, not on the UI thread: its module imports torch
        done = None
        try:
            # Behind the API server's queue the shared session takes the turn itself, once the
            # queue has come round to this answer (taking it here first would invert the order).
            shared = isinstance(session, SharedSession)
            with nullcontext() if shared else services.model_turn("an answer", cancel=cancel):
                sent = turns
                while True:
                    try:
                        # A prompt too long is refused before its first event: nothing was streamed.
                        for event in session.generate(sent, sampling, cancel):
                            if isinstance(event, TextPiece):
                                self.post_message(self.Streamed(event.text, len(event.token_ids)))
                            elif isinstance(event, Done):
                                done = event
                        break
                    except PromptTooLongError as error:
                        shorter = without_oldest_turn(sent) if drop_oldest_turns else None
                        if shorter is None:
                            raise MessageDoesNotFit(error, drop_oldest_turns) from error
                        sent = shorter
                if len(sent) < len(turns):
                    self.post_message(self.TurnsLeftOut(len(turns) - len(sent)))
                self._account_usage(services, counter, model_path, record_usage)
        except Cancelled:  # stopped while it waited for its turn (a bandwidth measurement, say)
            pass
        self.post_message(self.Answered(done))

    def on_chat_screen_turns_left_out(self, event: TurnsLeftOut) -> None:
        context = f"{self.plan.workload.context:,} tokens" if self.plan else "the context"
        self.notify(f"The conversation is longer than the model's context ({context}): its oldest "
                    f"{event.count} message{'s' if event.count > 1 else ''} were left out of this answer's "
                    "prompt (they stay here). Ctrl+N starts a new conversation.", timeout=8)

    def _account_usage(self, services, counter, model_path: Path, record: bool) -> None:
        """Add what the model counted since the last answer to its usage file, when the
        user records usage. The count runs in the engine whether or not it is recorded, so
        the new part is measured against the last snapshot either way: turning recording
        on later does not sweep in earlier answers."""
        try:
            counts = services.expert_counts(counter)
            if counts is None:  # llama.cpp: nothing counted (said when the model loaded)
                return
            try:
                new = counts.since(self._counted)
            except ValueError:  # the engine started counting afresh since: all it has is new
                new = counts
            self._counted = counts
            if record and new.activations:
                services.add_expert_counts(model_path, new)
        except (OSError, HybridMoeError) as error:  # the answer stands; the recording failed
            what = error.what if isinstance(error, HybridMoeError) else str(error)
            self.post_message(self.UsageNotRecorded(HybridMoeError(
                f"the expert usage of this answer was not recorded: {what}",
                "Check the free space of the data directory; turn recording off in the chat settings (Ctrl+S).")))

    def on_chat_screen_usage_not_recorded(self, event: UsageNotRecorded) -> None:
        self.app.show_error(event.error)

    async def on_chat_screen_streamed(self, event: Streamed) -> None:
        if self.answer is None:
            return
        now = time.monotonic()
        if self._first_token_s is None:
            self._first_token_s = now - self._t0
        self._tokens += event.tokens
        await self.answer.append(event.text)
        self.query_one(StatusLine).show_live(self._tokens, now - self._t0 - self._first_token_s, self._first_token_s)

    async def on_chat_screen_answered(self, event: Answered) -> None:
        done, answer = event.done, self.answer
        if answer is None:
            return
        if done is None:
            await self._finish_answer("cancelled")
            return
        if done.text and done.text != answer.text:
            answer.pieces = [done.text]  # the backend's text is the record
        await self._finish_answer(done.reason, stats=done.stats)

    async def _finish_answer(self, reason: str, stats=None) -> None:
        answer = self.answer
        self.answer = None  # pieces still queued after this point have no answer to go to
        await answer.end_stream(FINISH_NOTES.get(reason, reason))
        answer.finish_reason, answer.stats = reason, _stats_dict(stats) if stats else None
        self._save()
        status = self.query_one(StatusLine)
        if stats is not None:
            if self.plan is not None:
                self.app.services.remember_rates(self.plan, stats)
            self.context_used = stats.prompt_tokens + stats.generated_tokens
            status.show_stats(stats, self.plan.workload.context if self.plan else None,
                              self.plan.main_device if self.plan else "cpu", self.context_used,
                              expected=self.plan.decode_tokens_per_s_expected if self.plan else None)
        else:
            status.say(FINISH_NOTES.get(reason, reason))
        self.generating = False
        self.refresh_bindings()
        self.ensure_loaded()  # another model may have been chosen meanwhile

    async def on_worker_failed(self, event: WorkerFailed) -> None:
        # The App shows the dialog (the message bubbles on); here the screen gets usable again.
        if event.worker.group == "generate" and self.answer is not None:
            if isinstance(event.error, MessageDoesNotFit) and self.sent is not None and not self.answer.text:
                await self._take_back(self.sent)
                return
            await self._finish_answer("error")
        elif event.worker.group == "load":
            self.failed_target, self.loading_target = self.loading_target, None
            self.query_one("#load-panel").display = False
            self.query_one(StatusLine).say("the model did not load; Ctrl+L tries again")
            self.refresh_bindings()

    async def _take_back(self, sent: ChatMessage) -> None:
        """The message just sent could not be answered at all: it leaves the conversation (on
        screen and in the history) and its text goes back into the input, to shorten or keep."""
        answer, self.answer, self.sent = self.answer, None, None
        if answer is not None:
            await answer.remove()
        await self._forget(sent)
        prompt = self.query_one(PromptInput)
        prompt.text = sent.text
        prompt.move_cursor(prompt.document.end)
        prompt.focus()
        self.query_one(StatusLine).say("your message is back in the input: it does not fit the context")
        self.generating = False
        self.refresh_bindings()
        self.ensure_loaded()

    def action_stop(self) -> None:
        if self.generating:
            self.cancel.cancel()
        elif self.loading_target is not None:
            self.load_cancel.cancel()

    async def action_regenerate(self) -> None:
        last = self._last("assistant")
        if self.generating or self.session is None or last is None or self._last_message() is not last:
            return
        await self._forget(last)
        await self._start_answer()

    async def _forget(self, message: ChatMessage) -> None:
        """`message` leaves the screen and, where it was stored, the conversation's history."""
        stored_id = message.message_id if self._in_history() else None
        await message.remove()
        if stored_id is not None:
            try:
                self.app.history.delete_message(stored_id)
            except HistoryError as error:
                self._history_failed(error)

    def _last(self, role: str) -> ChatMessage | None:
        found = [m for m in self.query(ChatMessage) if m.role == role]
        return found[-1] if found else None

    def _last_message(self) -> ChatMessage | None:
        found = list(self.query(ChatMessage))
        return found[-1] if found else None

    # ---- conversations -----------------------------------------------------------------------------

    async def action_new_chat(self) -> None:
        if self.generating:
            self.notify("Stop the answer first (Esc).", severity="warning")
            return
        self.conversation = None
        self.system_prompt = self.app.state.system_prompt
        await self.query_one("#conversation", VerticalScroll).remove_children()
        self.refresh_bindings()
        self.query_one(PromptInput).focus()

    def action_conversations(self) -> None:
        if self.generating:
            self.notify("Stop the answer first (Esc).", severity="warning")
            return
        self.app.push_screen(ConversationsScreen(self.app.history), self._open_conversation)

    async def _open_conversation(self, conversation_id: int | None) -> None:
        if conversation_id is None:
            return
        await self.open_conversation(conversation_id)

    async def open_conversation(self, conversation_id: int) -> None:
        history = self.app.history
        try:
            conversation = history.get(conversation_id)
            messages = history.messages(conversation_id) if conversation is not None else []
        except HistoryError as error:  # the conversation on screen stays
            self.app.show_error(error)
            return
        if conversation is None:
            return
        self.conversation, self._history_generation = conversation, history.generation
        self.system_prompt = conversation.system_prompt
        log = self.query_one("#conversation", VerticalScroll)
        await log.remove_children()
        author = Path(conversation.model).name
        await log.mount_all([
            ChatMessage(m.role, m.content, author=author if m.role == "assistant" else "",
                        note=FINISH_NOTES.get(m.finish_reason or "stop", ""), message_id=m.id,
                        finish_reason=m.finish_reason, stats=m.stats)
            for m in messages
        ])
        log.anchor()
        self.refresh_bindings()

    def action_settings(self) -> None:
        def saved(result: ChatSettings | None) -> None:
            if result is None:
                return
            self.system_prompt = result.system_prompt
            self.app.update_state(system_prompt=result.system_prompt, sampling=result.sampling,
                                  drop_oldest_turns=result.drop_oldest_turns)
            if self._in_history():
                try:
                    self.app.history.update(self.conversation.id, system_prompt=result.system_prompt)
                except HistoryError as error:
                    self._history_failed(error)
            if result.record_usage != self.app.settings.record_stats:
                self.app.set_settings(replace(self.app.settings, record_stats=result.record_usage))
            self.notify("Chat settings saved." + (
                " Expert usage is recorded from the next answer on." if result.record_usage else ""))

        self.app.push_screen(ChatSettingsScreen(self.system_prompt, self.app.state.sampling,
                                                self.app.settings.record_stats, self.app.state.drop_oldest_turns),
                             saved)

    # ---- copying -----------------------------------------------------------------------------------

    def action_copy_answer(self) -> None:
        last = self._last("assistant")
        if last is None:
            self.notify("No answer to copy yet.", severity="warning")
            return
        self.app.copy_text(last.text, "answer")

    def action_copy_code(self) -> None:
        for message in reversed(list(self.query(ChatMessage))):
            blocks = code_blocks(message.text)
            if blocks:
                self.app.copy_text(blocks[-1], "code block")
                return
        self.notify("No code block in this conversation.", severity="warning")

    def on_unmount(self) -> None:
        # The model is the App's model service's: the App closes it as it quits.
        self.cancel.cancel()
        self.load_cancel.cancel()


class MessageDoesNotFit(HybridMoeError):
    """A message that does not fit the context even with the conversation's earlier turns
    left out: said with the keys that help."""

    def __init__(self, error: PromptTooLongError, drop_oldest_turns: bool):
        ways = ["shorten it", "start a new conversation (Ctrl+N)",
                "plan a longer context (F4, then save)"]
        if not drop_oldest_turns:
            ways.insert(1, "let the chat leave out the oldest turns (Ctrl+S)")
        super().__init__(error.what, f"Your message is back in the input: {', '.join(ways[:-1])} or {ways[-1]}.")


def without_oldest_turn(turns: list[ChatTurn]) -> list[ChatTurn] | None:
    """``turns`` without their oldest message (and its answer: the prompt starts at a user's
    turn); a leading system prompt stays. None when only the newest message is left."""
    system = turns[:1] if turns and turns[0].role == "system" else []
    rest = turns[len(system):]
    if len(rest) <= 1:
        return None
    rest = rest[1:]
    while len(rest) > 1 and rest[0].role != "user":
        rest = rest[1:]
    return system + rest


def limits_words(conversations: int, context: int) -> str:
    """What the loaded model serves: the conversations its KV cache holds at once (the chat's
    and the API server's requests together), and the tokens each may reach."""
    if conversations == 1:
        return f"context {context:,} tokens"
    return f"up to {conversations} conversations at once, {context:,} tokens each"


def _stats_dict(stats) -> dict:
    from dataclasses import asdict

    return asdict(stats)
