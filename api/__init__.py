"""The REST front end: accepts, validates, authorises and reads. It never trains."""
