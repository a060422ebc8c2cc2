"""The math of DeepSeek-V4.1 and its DSpark drafter, read like DeepSeek's reference."""
