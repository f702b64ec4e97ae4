# The node daemon's image: the server needs numpy and pyarrow, not torch (trainers bring their own).
FROM python:3.11-slim
RUN useradd --system --create-home msdata && mkdir -p /run/msdata /var/lib/msdata && chown msdata /run/msdata /var/lib/msdata
WORKDIR /opt/msdata
COPY pyproject.toml README.md ./
COPY msdata_client ./msdata_client
COPY msdata_server ./msdata_server
RUN pip install --no-cache-dir .
USER msdata
# Run with a large enough /dev/shm: docker run --shm-size=8g -v /run/msdata:/run/msdata ...
ENTRYPOINT ["msdata-server"]
CMD ["serve", "--config", "/etc/msdata/node.toml"]
