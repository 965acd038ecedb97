"""serve/: an exact speculative-decoding runner for trained heads; verify.py holds the acceptance rule."""
