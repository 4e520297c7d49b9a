# Installs weft as a library (docs: README "Install").
#   make install   [PREFIX=/usr/local] [DESTDIR=...] [WEFT_CUDA=0]
#   make uninstall [PREFIX=/usr/local] [DESTDIR=...]
# Layout: $(LIBDIR)/libweft.so, $(INCLUDEDIR)/weft.h, $(PKGCONFIGDIR)/weft.pc,
# $(LUADIR)/weft/**.lua, $(BINDIR)/weft-{run,topo,repl,tune,plot}. The Lua layer finds
# the library and the tools find the modules relative to where they are
# (lua/weft/internal/ffi.lua, scripts/weft-*), so a prefix needs no LD_LIBRARY_PATH or
# LUA_PATH; weft.pc's Libs carry an rpath, so C programs linked with
# `pkg-config --libs weft` find libweft.so too. uninstall removes the folders
# install created, when they are empty.
# luarocks (weft-dev-1.rockspec) passes PREFIX, LUADIR, LIBDIR, BINDIR.
PREFIX       ?= /usr/local
BINDIR       ?= $(PREFIX)/bin
LIBDIR       ?= $(PREFIX)/lib
INCLUDEDIR   ?= $(PREFIX)/include
LUADIR       ?= $(PREFIX)/share/lua/5.1
PKGCONFIGDIR ?= $(LIBDIR)/pkgconfig
WEFT_VERSION := dev

WEFT_TOOLS   := weft-run weft-topo weft-repl weft-tune weft-plot
# every module of the Lua layer, sub-folders included, relative to lua/
LUA_MODULES  := $(sort $(patsubst lua/%,%,$(shell find lua/weft -name '*.lua')))
# pkg-config paths relative to ${prefix} where they lie under it (relocatable)
pc_path = $(patsubst $(PREFIX)/%,$${prefix}/%,$(1))

# The folders install creates are listed in $(DIRS_FILE) (paths without
# DESTDIR, merged over installs) so that uninstall removes those, when empty,
# and never a folder that was there before (/usr/local/include, say).
DIRS_FILE    = $(DESTDIR)$(LUADIR)/weft/.install-dirs
INSTALL_DIRS = $(LIBDIR) $(INCLUDEDIR) $(PKGCONFIGDIR) $(BINDIR) $(LUADIR)/weft

.PHONY: install uninstall
install: lib
	$(call say,INSTALL,$(DESTDIR)$(PREFIX))created=$$(for x in $(INSTALL_DIRS); do \
	    while [ "$$x" != / ] && [ "$$x" != . ] && [ ! -d "$(DESTDIR)$$x" ]; do echo "$$x"; x=$$(dirname "$$x"); done; \
	  done; cat "$(DIRS_FILE)" 2>/dev/null); \
	install -d "$(DESTDIR)$(LIBDIR)" "$(DESTDIR)$(INCLUDEDIR)" \
	  "$(DESTDIR)$(PKGCONFIGDIR)" "$(DESTDIR)$(BINDIR)" && \
	rm -rf "$(DESTDIR)$(LUADIR)/weft" && install -d "$(DESTDIR)$(LUADIR)/weft" && \
	printf '%s\n' $$created | sort -u > "$(DIRS_FILE)"
	$(call say,LUA,$(DESTDIR)$(LUADIR)/weft ($(words $(LUA_MODULES)) modules))for m in $(LUA_MODULES); do \
	  install -D -m 644 "lua/$$m" "$(DESTDIR)$(LUADIR)/$$m" || exit 1; done
	$(call say,LIB,$(DESTDIR)$(LIBDIR)/libweft.so)install -m 755 $(LIB) "$(DESTDIR)$(LIBDIR)/libweft.so"
	$(call say,INC,$(DESTDIR)$(INCLUDEDIR)/weft.h)install -m 644 src/weft.h "$(DESTDIR)$(INCLUDEDIR)/weft.h"
	$(call say,PC,$(DESTDIR)$(PKGCONFIGDIR)/weft.pc)sed -e 's|@PREFIX@|$(PREFIX)|' \
	  -e 's|@LIBDIR@|$(call pc_path,$(LIBDIR))|' -e 's|@INCLUDEDIR@|$(call pc_path,$(INCLUDEDIR))|' \
	  -e 's|@VERSION@|$(WEFT_VERSION)|' mk/weft.pc.in > "$(DESTDIR)$(PKGCONFIGDIR)/weft.pc"
	$(call say,BIN,$(DESTDIR)$(BINDIR) ($(WEFT_TOOLS)))install -m 755 \
	  $(addprefix scripts/,$(WEFT_TOOLS)) "$(DESTDIR)$(BINDIR)/"

uninstall:
	$(call say,RM,$(DESTDIR)$(PREFIX) (weft files))created=$$(cat "$(DIRS_FILE)" 2>/dev/null); \
	rm -f "$(DESTDIR)$(LIBDIR)/libweft.so" \
	  "$(DESTDIR)$(INCLUDEDIR)/weft.h" "$(DESTDIR)$(PKGCONFIGDIR)/weft.pc" \
	  $(foreach t,$(WEFT_TOOLS),"$(DESTDIR)$(BINDIR)/$(t)") && \
	rm -rf "$(DESTDIR)$(LUADIR)/weft" && \
	for x in $$(printf '%s\n' $$created | awk '{ print length, $$0 }' | sort -rn | cut -d' ' -f2-); do \
	  rmdir "$(DESTDIR)$$x" 2>/dev/null || true; done
