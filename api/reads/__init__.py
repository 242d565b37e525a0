"""What one API process keeps in memory of what it read: the session and page cache, the kept
listings and attention pages, the summaries and ETags they are answered with, and the live
workers' load reports."""
