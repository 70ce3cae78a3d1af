"""Conversations, chat templates + loss masks, and prepared (tokenised) datasets."""

from eagletools.data.chat import tokenize_conversation
from eagletools.data.conversations import (
    Conversation,
    HubOptions,
    LoadReport,
    Message,
    load_conversations,
)
from eagletools.data.prepare import prepare, prepare_dataset

__all__ = [
    "Conversation",
    "HubOptions",
    "LoadReport",
    "Message",
    "load_conversations",
    "prepare",
    "prepare_dataset",
    "tokenize_conversation",
]
