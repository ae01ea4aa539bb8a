# The binaries image from this checkout's release build: the context is
# the folder deploy/docker/stage.sh fills (bin/ and libtorch/lib/).
FROM scratch
COPY . /opt/dflash
