"""The dashboard's static files (index.html, app.js, style.css, vendor/uPlot), package data
served by wattserve/daemon/api/dashboard.py. No Python lives here."""
