"""The one exception every entry point (train/, export/, serve/) turns into a single line on stderr, exit code 2."""


class UserError(Exception):
    """A problem with the user's input (config, data, checkpoint, prompts): one line that names the fix."""
