"""Text: tokenizers, chat templates, sampling and the token loop both backends share."""
